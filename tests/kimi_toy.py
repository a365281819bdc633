"""A Kimi-like test tokenizer, built locally (no download): byte-level BPE without merges (one token per
byte, so token layouts are exact and readable), Kimi's special tokens, the Kimi-like chat template in
tests/data/kimi_k2_chat_template.jinja. `slow_kimi_tokenizer` has no offsets (is_fast False), like
Kimi's tiktoken-based tokenizer."""
from __future__ import annotations

from pathlib import Path

TEMPLATE = Path(__file__).parent / "data" / "kimi_k2_chat_template.jinja"
SPECIALS = [
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<think>", "</think>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "[BOS]", "[EOS]",
]


def fast_kimi_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="[BOS]", eos_token="<|im_end|>",
                                   pad_token="[EOS]", chat_template=TEMPLATE.read_text())


def slow_kimi_tokenizer():
    """A pure-Python tokenizer (transformers' slow backend): characters + added special tokens, no offsets."""
    # One definition of the toy tokenizer: the same source the remote-code test writes to disk.
    ns: dict = {}
    exec(REMOTE_TOKENIZER_SOURCE, ns)
    CharTokenizer = ns["ToyKimiTokenizer"]

    tok = CharTokenizer(bos_token="[BOS]", eos_token="<|im_end|>", pad_token="[EOS]",
                        additional_special_tokens=SPECIALS)
    tok.chat_template = TEMPLATE.read_text()
    return tok


REMOTE_TOKENIZER_SOURCE = '''"""A remote-code tokenizer (like Kimi's tokenization_kimi.py): characters + special tokens, no offsets."""
from transformers import PreTrainedTokenizer


class ToyKimiTokenizer(PreTrainedTokenizer):
    vocab_files_names = {}

    def __init__(self, **kw):
        chars = [chr(i) for i in range(32, 127)] + ["\\n", "?"]
        self._vocab = {c: i for i, c in enumerate(dict.fromkeys(chars))}
        self._inv = {i: c for c, i in self._vocab.items()}
        super().__init__(**kw)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return {**self._vocab, **self.added_tokens_encoder}

    def _tokenize(self, text, **kw):
        return [c if c in self._vocab else "?" for c in text]

    def _convert_token_to_id(self, token):
        return self._vocab.get(token, self._vocab["?"])

    def _convert_id_to_token(self, index):
        return self._inv.get(index, "?")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def save_remote_code_tokenizer(dest: Path) -> Path:
    """Write a tokenizer that only loads with trust_remote_code=True (auto_map to a module in `dest`)."""
    import json

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenization_toy_kimi.py").write_text(REMOTE_TOKENIZER_SOURCE)
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ToyKimiTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_toy_kimi.ToyKimiTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "<|im_end|>", "pad_token": "[EOS]",
        "additional_special_tokens": SPECIALS, "chat_template": TEMPLATE.read_text(),
    }))
    return dest
