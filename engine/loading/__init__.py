"""How a model is loaded: from a path or Hub id to the parts an `Engine` is built from.

- `hub`: Hugging Face Hub ids (``org/name[@revision][:QUANT]``) resolved to local files.
- `assemble`: the composition root; options -> device, dense model, placement, expert store.
- `hf_folder`: Hugging Face checkpoint folders (config, safetensors, tokenizer).
- `ftw_load` / `ftw_provider`: FTW files: the dense model, and experts read on first use.
- `placement`: where the experts go ("auto" made concrete from budgets and free memory).
- `convert` / `calibrate` / `cache`: HF folders (and GGUF files, `gguf`) converted to FTW, with
  routing calibration for mixed precision, cached once per source.
- `fingerprint`: the weights digest that anchors and caches are keyed by.

The file format itself lives in `ftw` (layout, reader, writer) and the tensor codecs both loaders
use in `codecs`; nothing here imports the `Engine` (calibration is given a factory).
"""
