"""Build random-weight Llama-family checkpoints of real shapes, fp16 or AutoAWQ 4-bit, fast and cached.

The GPU machine reaches no Hub, so the benchmarks run on random weights of real shapes: the work per token is
the same. A model is written tensor by tensor, generated on the device it will run on (a 7B fp16 checkpoint is
13.5 GB: no fp32 HF model is ever instantiated), as safetensors shards with HF's parameter names and a
``model.safetensors.index.json``, so both Pagoda's loader and ``transformers.from_pretrained`` read it. AWQ
checkpoints go through the project's own round-to-nearest quantizer (engine/quant/rtn.py) and AutoAWQ GEMM
packer (engine/quant/awq.py), so they load through the real loader (engine/quant/formats.py). A small
word-level tokenizer (``w0 .. w{vocab-1}``) makes the folder a complete model.

Builds are cached in ``--cache`` as ``<shape>-<fp16|awq>`` with a ``bench-model.json`` stamp; a folder whose
stamp matches the requested build is reused. Command line:
``python3 bench/random_model.py --cache /tmp/pagoda-bench --device cuda llama2-7b:awq llama2-7b:fp16``
prints one folder per line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def llama_shape(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool,
                rope_theta: float, max_positions: int, family: str = "llama") -> dict:
    """A decoder's shape; ``family`` "qwen3" adds Qwen3's per-head q/k norms (and its config class)."""
    return {"hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "tie_word_embeddings": tied, "rope_theta": rope_theta, "max_position_embeddings": max_positions,
            "family": family}


SHAPES: dict[str, dict] = {
    # SmolLM2-135M: GQA 9/3 heads, tied embeddings
    "smollm2-135m": llama_shape(576, 1536, 30, 9, 3, 49152, True, 100000.0, 8192),
    # Llama-2-7B: MHA 32/32 heads
    "llama2-7b": llama_shape(4096, 11008, 32, 32, 32, 32000, False, 10000.0, 4096),
    # Llama-2-7B layer shape, 4 layers: a quick build for GPU tests
    "llama2-7b-4l": llama_shape(4096, 11008, 4, 32, 32, 32000, False, 10000.0, 4096),
    # Llama-3-8B: GQA 32/8 heads, 128k vocabulary
    "llama3-8b": llama_shape(4096, 14336, 32, 32, 8, 128256, False, 500000.0, 8192),
    # Qwen3-8B: GQA 32/8 heads, q/k norms, 36 layers, 152k vocabulary
    "qwen3-8b": llama_shape(4096, 12288, 36, 32, 8, 151936, False, 1000000.0, 40960, family="qwen3"),
    # a CPU check of the scripts end to end (GQA 4/2, untied head)
    "tiny": llama_shape(64, 128, 2, 4, 2, 512, False, 10000.0, 4096),
}
QUANTS = ("fp16", "awq")
INIT_STD = 0.02  # HF's initializer_range: keeps a 32-layer random stack finite in fp16
SHARD_BYTES = 2 << 30  # at most this much host memory holds tensors waiting to be written
STAMP = "bench-model.json"
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class BuildSpec:
    """Everything that decides a build's bytes; its JSON is the cache stamp."""

    shape: str
    quant: str = "fp16"
    group_size: int = 0  # AWQ only; 0: 128 where it divides every input size, else 32
    seed: int = 0

    @property
    def folder_name(self) -> str:
        return f"{self.shape}-{self.quant}"


def parse_spec(text: str) -> BuildSpec:
    """'llama2-7b:awq' -> BuildSpec; the quant defaults to fp16."""
    shape, _, quant = text.partition(":")
    quant = quant or "fp16"
    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise SystemExit(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTS)}")
    return BuildSpec(shape, quant)


def awq_group_size(shape: dict, requested: int = 0) -> int:
    """128 (AutoAWQ's default) when it divides hidden and intermediate sizes, else 32 (576 % 128 != 0)."""
    if requested:
        return requested
    sizes = (shape["hidden_size"], shape["intermediate_size"])
    return 128 if all(s % 128 == 0 for s in sizes) else 32


def head_dim(shape: dict) -> int:
    return shape["hidden_size"] // shape["num_attention_heads"]


def config_dict(shape: dict) -> dict:
    """A plain HF ``config.json`` (no transformers-version-specific fields) for LlamaForCausalLM (or
    Qwen3ForCausalLM)."""
    qwen3 = shape["family"] == "qwen3"
    return {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama", "hidden_act": "silu",
        "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_hidden_layers": shape["num_hidden_layers"], "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"], "head_dim": head_dim(shape),
        "vocab_size": shape["vocab_size"], "tie_word_embeddings": shape["tie_word_embeddings"],
        "rope_theta": shape["rope_theta"], "max_position_embeddings": shape["max_position_embeddings"],
        "rms_norm_eps": 1e-6 if qwen3 else 1e-5, "initializer_range": INIT_STD, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": True,
        "torch_dtype": "float16", "dtype": "float16",
    }


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """Word-level tokenizer over ``w0 .. w{vocab-1}`` (w0 unk, w1 bos, w2 eos): any token id round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2", bos_token="w1", unk_token="w0",
                                   pad_token="w0")
    fast.save_pretrained(folder)


def linear_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """HF Linear weight shapes [out, in] of one decoder layer."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * head_dim(shape), shape["num_key_value_heads"] * head_dim(shape)
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i)}


class TensorMaker:
    """Random tensors on one device from one seeded generator (the same spec gives the same bytes there)."""

    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, rows: int, cols: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        out = torch.empty(rows, cols, dtype=dtype, device=self.device)  # [rows, cols]
        return out.normal_(0.0, INIT_STD, generator=self.gen)


def layer_tensors(maker: TensorMaker, shape: dict, index: int, spec: BuildSpec) -> dict[str, torch.Tensor]:
    """One decoder layer's checkpoint tensors (on the build device), fp16 or AutoAWQ GEMM."""
    from engine.quant.awq import awq_tensors
    from engine.quant.rtn import quantize_grouped

    prefix = f"model.layers.{index}"
    h = shape["hidden_size"]
    ones = torch.ones(h, dtype=torch.float16, device=maker.device)
    out = {f"{prefix}.input_layernorm.weight": ones,
           f"{prefix}.post_attention_layernorm.weight": ones.clone()}
    if shape["family"] == "qwen3":  # RMSNorm of each q and k head before rotary
        for norm in ("q_norm", "k_norm"):
            out[f"{prefix}.self_attn.{norm}.weight"] = torch.ones(head_dim(shape), dtype=torch.float16,
                                                                  device=maker.device)
    group = awq_group_size(shape, spec.group_size)
    for name, (rows, cols) in linear_shapes(shape).items():
        if spec.quant == "fp16":
            out[f"{prefix}.{name}.weight"] = maker.normal(rows, cols)
            continue
        weight = maker.normal(rows, cols, torch.float32)  # [out, in]
        codes, scales, zeros = quantize_grouped(weight, group)  # AutoAWQ's min/max grid
        # qweight [in, out/8], qzeros [in/G, out/8], scales [in/G, out]
        packed = awq_tensors(codes, scales, zeros)
        out.update({f"{prefix}.{name}.{key}": value for key, value in packed.items()})
        del weight, codes, scales, zeros
    return out


def shard_plan(shape: dict, spec: BuildSpec) -> list[list[str]]:
    """Groups of units ('embed', 'head', 'layer.N') whose tensors make one shard of at most ~SHARD_BYTES."""
    params = sum(r * c for r, c in linear_shapes(shape).values())
    layer_bytes = params * (2 if spec.quant == "fp16" else 0.6)
    per_shard = max(1, int(SHARD_BYTES // max(layer_bytes, 1)))
    layers = [f"layer.{i}" for i in range(shape["num_hidden_layers"])]
    head = ["embed"] + ([] if shape["tie_word_embeddings"] else ["head"])
    return [head] + [layers[i:i + per_shard] for i in range(0, len(layers), per_shard)]


def unit_tensors(maker: TensorMaker, shape: dict, unit: str, spec: BuildSpec) -> dict[str, torch.Tensor]:
    v, h = shape["vocab_size"], shape["hidden_size"]
    if unit == "embed":
        return {"model.embed_tokens.weight": maker.normal(v, h),
                "model.norm.weight": torch.ones(h, dtype=torch.float16, device=maker.device)}
    if unit == "head":
        return {"lm_head.weight": maker.normal(v, h)}
    return layer_tensors(maker, shape, int(unit.split(".")[1]), spec)


def iter_shards(shape: dict, spec: BuildSpec, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Shards of host tensors, generated on ``device`` (transfers overlap nothing: simple and fast enough)."""
    maker = TensorMaker(device, spec.seed)
    for units in shard_plan(shape, spec):
        shard: dict[str, torch.Tensor] = {}
        for unit in units:
            tensors = unit_tensors(maker, shape, unit, spec)
            shard.update({k: t.to("cpu").contiguous() for k, t in tensors.items()})
        yield shard


def write_checkpoint(folder: Path, spec: BuildSpec, device: torch.device) -> None:
    """Shards + index + config.json (+ AWQ quantization_config) + tokenizer into ``folder``."""
    from safetensors.torch import save_file

    from engine.quant.awq import AWQMethod

    shape = SHAPES[spec.shape]
    num_shards = len(shard_plan(shape, spec))
    weight_map: dict[str, str] = {}
    total = 0
    for n, shard in enumerate(iter_shards(shape, spec, device), start=1):
        name = f"model-{n:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        for key, tensor in shard.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    config = config_dict(shape)
    if spec.quant == "awq":
        config["quantization_config"] = AWQMethod(4, awq_group_size(shape, spec.group_size)).config_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}) + "\n")
    write_word_tokenizer(folder, shape["vocab_size"])


def build_model(cache: Path | str, spec: BuildSpec, device: str | torch.device = "cpu",
                log=lambda message: print(message, file=sys.stderr, flush=True)) -> Path:
    """The folder of ``spec`` under ``cache``, built (in a temporary folder, then renamed) unless there."""
    cache = Path(cache)
    folder = cache / spec.folder_name
    stamp = json.dumps(asdict(spec), sort_keys=True)
    if (folder / STAMP).is_file() and (folder / STAMP).read_text() == stamp:
        return folder
    device = torch.device(device)
    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob(f".{spec.folder_name}-*"):  # a build that was killed (a 7B one is 13.5 GB)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}-", dir=cache))
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            write_checkpoint(tmp, spec, device)
        (tmp / STAMP).write_text(stamp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.chmod(0o755)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**30
    log(f"built {folder} ({size:.2f} GiB) on {device} in {time.perf_counter() - start:.1f} s")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help=f"shape[:quant], shapes {', '.join(SHAPES)}; quant fp16|awq")
    parser.add_argument("--cache", required=True, help="folder that keeps the builds")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for text in args.specs:
        spec = parse_spec(text)
        folder = build_model(args.cache, BuildSpec(spec.shape, spec.quant, seed=args.seed), args.device)
        print(folder, flush=True)


if __name__ == "__main__":
    main()
