"""Build a LlamaModel (Gemma3Model for Gemma 3) from a HF folder: config.json + safetensors (sharded or not),
dense or AWQ/GPTQ 4-bit.

No pickle, no trust_remote_code. q/k/v and gate/up are merged at load so each runs as one matmul; Phi-3
checkpoints store them merged already (``qkv_proj``, ``gate_up_proj``, quantized as one matrix each in 4-bit
builds), which load as they are. Every missing tensor or shape mismatch is an EngineError naming the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import GEMMA3, ModelConfig, check_context_limit, read_folder_quantization_config
from engine.errors import EngineError
from engine.layers.linear import Int8Rows, Linear, RowParallelLinear, Weight, column_shard, row_shard
from engine.layers.rotary import cos_sin_cache
from engine.models.fused_decode import fused_decode_unsupported, x16_rows_supported
from engine.models.gemma3 import Gemma3Model, unit_offset_norm_weight
from engine.models.llama import DecoderLayer, LlamaModel
from engine.parallel import TPGroup, TPShard, check_divides
from kernels.ops import Backend


class TensorStore:
    """Lazy access to the tensors of all safetensors files in a folder, by name."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise EngineError(f"no .safetensors files in {model_dir} (Pagoda does not load pickle checkpoints)")
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for path in files:
            handle = safe_open(str(path), framework="pt")
            self._handles[path] = handle
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._where[name] = path

    def get(self, name: str) -> torch.Tensor | None:
        path = self._where.get(name)
        return None if path is None else self._handles[path].get_tensor(name)

    def require(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise EngineError(f"checkpoint is missing tensor {name!r}")
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise EngineError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)} "
                              "from config.json")
        return tensor


def _dense(store: TensorStore, prefix: str, out_f: int, in_f: int, device, dtype) -> torch.Tensor:
    return store.require(f"{prefix}.weight", (out_f, in_f)).to(device, dtype)


class WeightLoader:
    """Loads the linear layers of one checkpoint, dense or quantized, onto a device. Under tensor parallelism
    (``tp``) it keeps this rank's shard: column-parallel layers (``merged``) a slice of each output block,
    row-parallel ones (``row_parallel``) a slice of the input features (Megatron-style)."""

    def __init__(self, store: TensorStore, quant_method, device: torch.device, dtype: torch.dtype, backend: Backend,
                 tp: TPGroup | None = None):
        self.store, self.quant, self.device, self.dtype, self.backend = store, quant_method, device, dtype, backend
        self.tp = tp
        self.shard: TPShard | None = None if tp is None else tp.shard

    def weight(self, prefix: str, out_f: int, in_f: int) -> Weight:
        if self.quant is not None and self.quant.is_quantized(prefix):
            # the repack into the kernel layout runs where the weights go: a GPU does a 7B model's in well
            # under a second, where the CPU would take many
            packed = self.quant.load_linear(self._get_on_device, prefix, in_f, out_f, self.dtype)
            return packed.to(self.device, self.dtype)
        return _dense(self.store, prefix, out_f, in_f, self.device, self.dtype)

    def _get_on_device(self, name: str) -> torch.Tensor | None:
        tensor = self.store.get(name)
        return None if tensor is None else tensor.to(self.device)

    def bias(self, prefix: str, out_f: int) -> torch.Tensor | None:
        bias = self.store.get(f"{prefix}.bias")
        if bias is None:
            return None
        if tuple(bias.shape) != (out_f,):
            raise EngineError(f"tensor '{prefix}.bias' has shape {tuple(bias.shape)}, expected ({out_f},)")
        return bias.to(self.device, self.dtype)

    def _biases(self, prefixes: list[str], out_sizes: list[int]) -> list[torch.Tensor]:
        biases = [self.bias(p, o) for p, o in zip(prefixes, out_sizes)]
        if any(b is None for b in biases):
            missing = prefixes[[b is None for b in biases].index(True)]
            raise EngineError(f"checkpoint is missing tensor '{missing}.bias' (config says attention_bias)")
        return biases

    def merged(self, prefixes: list[str], out_sizes: list[int], in_f: int, with_bias: bool,
               blocks: list[list[int]] | None = None) -> Linear:
        """One Linear of the parts ``prefixes`` stacked along the output. ``blocks`` (a stored fused matrix,
        Phi-3): the output blocks within each part (q, k, v), which tensor parallelism splits one by one."""
        parts = [self.weight(p, o, in_f) for p, o in zip(prefixes, out_sizes)]
        biases = self._biases(prefixes, out_sizes) if with_bias else None
        if self.shard is not None:  # column-parallel: this rank's slice of every output block
            ranges = self._column_ranges(out_sizes, blocks or [[o] for o in out_sizes])
            parts = [column_shard(w, a, b) for w, part in zip(parts, ranges) for a, b in part]
            if biases is not None:
                biases = [bias[a:b] for bias, part in zip(biases, ranges) for a, b in part]
        return Linear(parts, None if biases is None else torch.cat(biases), self.backend)

    def _column_ranges(self, out_sizes: list[int], blocks: list[list[int]]) -> list[list[tuple[int, int]]]:
        """Per part: this rank's [start, end) of each block, as offsets into the part's output features."""
        ranges = []
        for size, part_blocks in zip(out_sizes, blocks):
            assert sum(part_blocks) == size
            offset, part = 0, []
            for block in part_blocks:
                start, end = self.shard.slice_of(block)
                part.append((offset + start, offset + end))
                offset += block
            ranges.append(part)
        return ranges

    def row_parallel(self, prefix: str, out_f: int, in_f: int, with_bias: bool) -> Linear | RowParallelLinear:
        """o_proj / down_proj: the whole layer, or under tensor parallelism this rank's input features, whose
        partial output the all-reduce sums (the bias added once, after it)."""
        if self.tp is None:
            return self.merged([prefix], [out_f], in_f, with_bias)
        start, end = self.shard.slice_of(in_f)
        weight = row_shard(self.weight(prefix, out_f, in_f), start, end, prefix)
        bias = self._biases([prefix], [out_f])[0] if with_bias else None
        return RowParallelLinear(Linear([weight], None, self.backend), bias, self.tp)

    def quantized_head(self) -> bool:
        """Whether the checkpoint packs its LM head too (GPTQModel's ``lm_head: true``)."""
        return self.quant is not None and self.quant.is_quantized("lm_head")

    def packed_head(self, vocab_size: int, hidden: int) -> Linear:
        """A packed LM head [hidden -> vocab] as a Linear (the W4A16 kernels, or its dense CPU copy). Not split
        over tensor-parallel ranks: their heads are vocabulary slices of a dense matrix."""
        if self.shard is not None:
            raise EngineError("this checkpoint's lm_head is quantized (GPTQ lm_head: true), which is not split "
                              "across ranks; use --tensor-parallel-size 1", param="tensor_parallel_size")
        return Linear([self.weight("lm_head", vocab_size, hidden)], None, self.backend)

    def vocab_rows(self, name: str, vocab_size: int, hidden: int) -> torch.Tensor:
        """The embedding or head [vocab, hidden]; under tensor parallelism this rank's contiguous vocabulary
        slice, zero-padded to the common width (TPShard.vocab_slice)."""
        tensor = self.store.require(name, (vocab_size, hidden))
        if self.shard is not None:
            start, end = self.shard.vocab_slice(vocab_size)
            rows = torch.zeros((self.shard.vocab_width(vocab_size), hidden), dtype=tensor.dtype)
            rows[:end - start] = tensor[start:end]
            tensor = rows
        return tensor.to(self.device, self.dtype)


def _input_projections(loader: WeightLoader, cfg: ModelConfig, p: str) -> tuple[Linear, Linear]:
    """(qkv_proj, gate_up_proj) of layer prefix ``p``: merged from their parts, or as stored (Phi-3, no biases)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attn = f"{p}.self_attn"
    if cfg.fused_projections:
        return (loader.merged([f"{attn}.qkv_proj"], [q_out + 2 * kv_out], h, with_bias=False,
                              blocks=[[q_out, kv_out, kv_out]]),
                loader.merged([f"{p}.mlp.gate_up_proj"], [2 * inter], h, with_bias=False, blocks=[[inter, inter]]))
    return (loader.merged([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], [q_out, kv_out, kv_out], h,
                          with_bias=cfg.attention_bias),
            loader.merged([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], [inter, inter], h, with_bias=cfg.mlp_bias))


def _norm(loader: WeightLoader, cfg: ModelConfig, name: str, size: int) -> torch.Tensor:
    """Norm weight ``name`` [size] in the activation dtype; Gemma's as the float32 1 + weight it scales by."""
    weight = loader.store.require(f"{name}.weight", (size,)).to(loader.device, loader.dtype)
    return unit_offset_norm_weight(weight) if cfg.architecture == GEMMA3 else weight


def _load_layer(loader: WeightLoader, cfg: ModelConfig, i: int) -> DecoderLayer:
    p = f"model.layers.{i}"
    h, q_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    gemma = cfg.architecture == GEMMA3

    def norm(name: str, size: int = h) -> torch.Tensor:
        return _norm(loader, cfg, f"{p}.{name}", size)

    qkv_proj, gate_up_proj = _input_projections(loader, cfg, p)
    return DecoderLayer(
        input_layernorm=norm("input_layernorm"),
        qkv_proj=qkv_proj,
        o_proj=loader.row_parallel(f"{p}.self_attn.o_proj", h, q_out, with_bias=cfg.o_proj_bias),
        post_attention_layernorm=norm("post_attention_layernorm"),
        gate_up_proj=gate_up_proj,
        down_proj=loader.row_parallel(f"{p}.mlp.down_proj", h, cfg.intermediate_size, with_bias=cfg.mlp_bias),
        q_norm=norm("self_attn.q_norm", cfg.head_dim) if cfg.qk_norm else None,
        k_norm=norm("self_attn.k_norm", cfg.head_dim) if cfg.qk_norm else None,
        pre_feedforward_layernorm=norm("pre_feedforward_layernorm") if gemma else None,
        post_feedforward_layernorm=norm("post_feedforward_layernorm") if gemma else None,
    )


def rank_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config one rank's attention, MLP and KV cache see: its share of the heads and MLP columns (the
    vocabulary stays whole: logits are gathered before sampling)."""
    return replace(cfg, num_heads=cfg.num_heads // world_size, num_kv_heads=cfg.num_kv_heads // world_size,
                   intermediate_size=cfg.intermediate_size // world_size)


def read_config_dict(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise EngineError(f"no config.json in {model_dir}: not a model folder")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise EngineError(f"config.json in {model_dir} is not valid JSON: {exc}") from exc


def _quantized_head(lm_head: torch.Tensor | Linear, quantization: str, backend: Backend, cfg: ModelConfig
                    ) -> torch.Tensor | Int8Rows | Linear:
    """The LM head as ``EngineArgs.lm_head_quantization`` asks: as loaded ("none") or as int8 rows ("int8"),
    whose kernels need fp16/bf16 activations and K a multiple of 16 on the GPU."""
    if quantization == "none":
        return lm_head
    if quantization != "int8":
        raise EngineError(f"unknown lm_head quantization {quantization!r}; choose none or int8",
                          param="lm_head_quantization")
    if isinstance(lm_head, Linear):
        raise EngineError("--lm-head-quantization int8: this checkpoint's lm_head is already packed int4 "
                          "(GPTQ lm_head: true); use --lm-head-quantization none", param="lm_head_quantization")
    if backend.use_triton and (lm_head.dtype not in (torch.float16, torch.bfloat16) or cfg.hidden_size % 16):
        raise EngineError(f"--lm-head-quantization int8 needs float16 or bfloat16 activations and a hidden size "
                          f"that is a multiple of 16 on the GPU (here {lm_head.dtype}, {cfg.hidden_size})",
                          param="lm_head_quantization")
    return Int8Rows.quantize(lm_head)


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype, backend: Backend,
               max_positions: int, log: Callable[[str], None] = lambda m: None, fuse_decode: bool = True,
               tp: TPGroup | None = None, x16_rows: bool = False, lm_head_quantization: str = "none") -> LlamaModel:
    """Read config + weights into a LlamaModel on ``device`` in ``dtype`` (activations; int4 stays packed).
    ``fuse_decode``: one-sequence decode steps use the fused layer when the Triton kernels run and the model
    allows it (engine/models/fused_decode.py), with ``x16_rows`` its int4 rows in 16-bit fixed point where
    that pays (``x16_rows_supported``). ``tp``: load this rank's shard of a tensor-parallel group; the
    model's config then holds the per-rank head counts and MLP width. ``lm_head_quantization`` "int8": the
    head (this rank's vocabulary rows) is kept as ``Int8Rows`` (a tied embedding stays as loaded for the
    lookups)."""
    raw = read_config_dict(model_dir)
    cfg = ModelConfig.from_dict(raw)
    check_context_limit(cfg, max_positions)
    if tp is not None:
        check_divides(cfg, tp.world_size)
    rope = cos_sin_cache(cfg.rotary_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)  # refuses first
    quant = None
    if read_folder_quantization_config(model_dir, raw) is not None:  # config.json or a side file
        from engine.quant import get_quant_method

        quant = get_quant_method(model_dir, raw)
    store = TensorStore(model_dir)
    loader = WeightLoader(store, quant, device, dtype, backend, tp)
    embed = loader.vocab_rows("model.embed_tokens.weight", cfg.vocab_size, cfg.hidden_size)
    layers = []
    for i in range(cfg.num_layers):
        layers.append(_load_layer(loader, cfg, i))
        log(f"loaded layer {i + 1}/{cfg.num_layers}")
    if loader.quantized_head():  # packed in the checkpoint (then stored apart from a tied embedding)
        lm_head = loader.packed_head(cfg.vocab_size, cfg.hidden_size)
    elif cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = loader.vocab_rows("lm_head.weight", cfg.vocab_size, cfg.hidden_size)
    lm_head = _quantized_head(lm_head, lm_head_quantization, backend, cfg)
    norm = _norm(loader, cfg, "model.norm", cfg.hidden_size)
    if cfg.architecture == GEMMA3:
        local_rope = cos_sin_cache(cfg.rotary_dim, max_positions, cfg.local_rope_theta, None, device)
        model = Gemma3Model(cfg, backend, embed, layers, norm, lm_head, rope, local_cos_sin_cache=local_rope)
    elif tp is not None:
        model = LlamaModel(rank_config(cfg, tp.world_size), backend, embed, layers, norm, lm_head, rope, tp=tp,
                           vocab_start=tp.shard.vocab_slice(cfg.vocab_size)[0])
    else:
        model = LlamaModel(cfg, backend, embed, layers, norm, lm_head, rope)
    if backend.use_triton and fuse_decode:  # the reference backend keeps its dense CPU weights for every step
        reason = fused_decode_unsupported(model)
        model.fuse_one_row_decode = reason is None
        model.one_row_x16 = reason is None and x16_rows and x16_rows_supported(model)
        log("one-sequence decode: " + ("unfused ({reason})" if reason is not None else
                                       "fused layer, int4 rows in 16-bit fixed point" if model.one_row_x16 else
                                       "fused layer").format(reason=reason))
    return model
