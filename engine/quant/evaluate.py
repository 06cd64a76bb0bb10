"""Check a quantized checkpoint's quality: dequantize it through Pagoda's loader into transformers, measure perplexity.

This is the yardstick of the quantizer (tests and BENCHMARKS.md): the weights go through exactly the
loader the engine uses (``get_quant_method`` -> ``load_linear`` -> ``PackedInt4``), are expanded with the
reference kernel's ``dequantize_int4``, and replace the weights of a plain transformers model, whose
perplexity on held-out text is then comparable with the fp16 model's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import EngineError
from engine.layers.linear import PackedInt4
from engine.quant.formats import get_quant_method
from kernels.reference import dequantize_int4


def dense_weight(packed: PackedInt4) -> torch.Tensor:
    """PackedInt4 -> dense nn.Linear weight [out, in] in the original input order (undoes ``perm``)."""
    w = dequantize_int4(packed.qweight, packed.scales, packed.zeros, packed.group_size)  # [in, out], rows permuted
    if packed.perm is not None:
        unpermuted = torch.empty_like(w)
        unpermuted[packed.perm] = w
        w = unpermuted
    return w.t().contiguous()


def dense_state_dict(model_dir: Path, dtype: torch.dtype = torch.float32) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config without quantization_config, dense state dict) of a checkpoint, via Pagoda's loader."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    method = get_quant_method(model_dir, config)
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (not iterable)
    state: dict[str, torch.Tensor] = {}
    packed_prefixes = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".qweight")}
    for name, value in tensors.items():
        prefix, _, _leaf = name.rpartition(".")
        if prefix not in packed_prefixes:
            state[name] = value.to(dtype) if value.is_floating_point() else value
    for prefix in sorted(packed_prefixes):
        if method is None or not method.is_quantized(prefix):
            raise EngineError(f"tensor '{prefix}.qweight' found but the config does not quantize {prefix}",
                              param=f"{prefix}.qweight")
        qweight = tensors[f"{prefix}.qweight"]
        in_features, out_features = _linear_shape(method.name, qweight)
        packed = method.load_linear(tensors.get, prefix, in_features, out_features, dtype)
        state[f"{prefix}.weight"] = dense_weight(packed)
    config.pop("quantization_config", None)
    return config, state


def _linear_shape(method: str, qweight: torch.Tensor) -> tuple[int, int]:
    if method == "awq":
        return qweight.shape[0], qweight.shape[1] * 8
    return qweight.shape[0] * 8, qweight.shape[1]


def load_dense_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    """A transformers causal LM holding the checkpoint's (dequantized) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict, state = dense_state_dict(model_dir, dtype)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise EngineError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _windows(input_ids: torch.Tensor, window: int):
    """Non-overlapping windows of ``input_ids`` [num_tokens], each one token longer than the inputs it scores."""
    for start in range(0, input_ids.numel() - 1, window):
        chunk = input_ids[start:start + window + 1]
        if chunk.numel() >= 2:
            yield chunk


@torch.no_grad()
def perplexity(model, input_ids: torch.Tensor, window: int = 2048) -> float:
    """exp(mean next-token negative log-likelihood) over ``input_ids`` [num_tokens], in non-overlapping windows."""
    total_nll, total_tokens = 0.0, 0
    for chunk in _windows(input_ids, window):
        logits = model(chunk[None, :-1]).logits[0].float()  # [len, vocab]
        total_nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        total_tokens += chunk.numel() - 1
    return math.exp(total_nll / total_tokens)


@dataclass(frozen=True)
class Agreement:
    """How a (quantized) model compares with its full-precision reference on the same text."""

    perplexity: float
    reference_perplexity: float
    top1_agreement: float  # fraction of positions whose most likely next token is the reference's

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity


@torch.no_grad()
def window_logits(model, input_ids: torch.Tensor, window: int = 2048) -> list[torch.Tensor]:
    """The model's float32 logits [len, vocab] on each window of ``input_ids`` that ``compare`` scores: a
    reference computed once for several models (keeps num_tokens x vocab floats: for short texts)."""
    return [model(chunk[None, :-1]).logits[0].float() for chunk in _windows(input_ids, window)]


@torch.no_grad()
def compare(model, reference, input_ids: torch.Tensor, window: int = 2048) -> Agreement:
    """Teacher-forced comparison on ``input_ids`` [num_tokens]: both perplexities and top-1 agreement.

    ``reference``: a model, or its ``window_logits`` on the same ``input_ids`` and ``window``.
    Top-1 agreement asks, at every position of the real text, whether the model would greedily pick the token
    the reference picks: closer to what a user sees than perplexity, without hanging on one sampled answer.
    """
    nll = {"model": 0.0, "reference": 0.0}
    agree, total = 0, 0
    for i, chunk in enumerate(_windows(input_ids, window)):
        targets = chunk[1:]
        logits = model(chunk[None, :-1]).logits[0].float()  # [len, vocab]
        if isinstance(reference, list):
            ref_logits = reference[i]  # [len, vocab]
        else:
            ref_logits = reference(chunk[None, :-1]).logits[0].float()
        nll["model"] += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        nll["reference"] += torch.nn.functional.cross_entropy(ref_logits, targets, reduction="sum").item()
        agree += int((logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        total += targets.numel()
    return Agreement(math.exp(nll["model"] / total), math.exp(nll["reference"] / total), agree / total)


def main(argv: list[str] | None = None) -> None:
    """``python -m engine.quant.evaluate DIR [DIR ...] [--text FILE] [--reference DIR]``: quality of checkpoints.

    With ``--reference`` (the fp16 model they were built from) each line adds the perplexity ratio and the
    teacher-forced top-1 agreement, the figures tests/test_quantized_chat.py bounds.
    """
    import argparse

    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description="Perplexity of dense or AWQ/GPTQ checkpoints (via Pagoda's loader)")
    parser.add_argument("model_dirs", nargs="+", type=Path)
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parents[2] / "data" / "heldout.txt")
    parser.add_argument("--reference", type=Path, default=None, help="full-precision model to compare with")
    args = parser.parse_args(argv)
    reference = load_dense_model(args.reference) if args.reference else None
    for model_dir in args.model_dirs:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        ids = torch.tensor(tokenizer(args.text.read_text()).input_ids)
        model = load_dense_model(model_dir)
        if reference is None:
            print(f"{model_dir}: perplexity {perplexity(model, ids):.3f} on {ids.numel()} tokens")
            continue
        result = compare(model, reference, ids)
        print(f"{model_dir}: perplexity {result.perplexity:.3f} (reference {result.reference_perplexity:.3f}, "
              f"ratio {result.perplexity_ratio:.4f}), top-1 agreement {result.top1_agreement:.4f} "
              f"on {ids.numel()} tokens")


if __name__ == "__main__":
    main()
