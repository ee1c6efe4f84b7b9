"""Export a trained checkpoint as ONNX, TorchScript or safetensors, with PATH.json stating its
preprocessing and class names; the file is checked against PyTorch when written (common/use/exporting.py).

    python export.py --checkpoint FILE --format onnx|torchscript|safetensors --output PATH
"""
# The package's import comes first (this script's only one): a Ctrl-C from torch's import on ends the
# program with one line and status 130, its output never cut (common/interrupts.py).
from common.use.exporting import main

if __name__ == "__main__":
    main()
