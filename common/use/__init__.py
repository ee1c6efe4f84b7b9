"""Using a trained model: the programs behind evaluate.py, predict.py and export.py. Finding and
reading a checkpoint and rebuilding its model (source), exact evaluation at any world size with
per-class accuracy and the confusion matrix (evaluating), class probabilities for image files
(predicting), and ONNX, TorchScript and safetensors files with their preprocessing (exporting).

May import: every layer below it (the base, parallel/, data/, output/, train/). Nothing under
common/ imports it; the three scripts do.
"""
