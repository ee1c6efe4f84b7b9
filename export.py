"""Export a trained checkpoint as ONNX, TorchScript or safetensors, with PATH.json stating its
preprocessing and class names; the file is checked against PyTorch when written (common/use/exporting.py).

    python export.py --checkpoint FILE --format onnx|torchscript|safetensors --output PATH
"""
from common.use.exporting import main

if __name__ == "__main__":
    main()
