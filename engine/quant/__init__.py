"""4-bit AWQ / GPTQ: load Hub checkpoints into Pagoda's packed int4 layout, and make such checkpoints ourselves.

Loading: ``get_quant_method(model_dir, config)`` -> ``QuantMethod`` (or None) with ``is_quantized(prefix)`` and
``load_linear(get_tensor, prefix, in_features, out_features, dtype) -> PackedInt4``.
Making: ``quantize_model(src_dir, out_dir, method='awq'|'gptq'|'rtn', ...)`` and, for the catalog's bundled
entries, ``build_bundled_quantized(base_dir, out_dir, method)``.
"""

from engine.quant.formats import QuantMethod, get_quant_method
from engine.quant.quantizer import build_bundled_quantized, quantize_model

__all__ = ["QuantMethod", "build_bundled_quantized", "get_quant_method", "quantize_model"]
