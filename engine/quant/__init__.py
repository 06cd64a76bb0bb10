"""4-bit AWQ / GPTQ: load Hub checkpoints into Pagoda's packed int4 layout, and make such checkpoints ourselves.

Loading (formats.py, awq.py, gptq.py; what the model loader imports): ``get_quant_method(model_dir, config)`` ->
``QuantMethod`` (or None) with ``is_quantized(prefix)`` and
``load_linear(get_tensor, prefix, in_features, out_features, dtype) -> PackedInt4``.
Making (quantizer.py and the calibration, search and writing modules it uses; never imported by loading):
``engine.quant.quantizer.quantize_model(src_dir, out_dir, method='awq'|'gptq'|'rtn', ...)`` and, for the catalog's
bundled entries, ``engine.quant.quantizer.build_bundled_quantized(base_dir, out_dir, method)``.
"""

from engine.quant.formats import QuantMethod, get_quant_method

__all__ = ["QuantMethod", "get_quant_method"]
