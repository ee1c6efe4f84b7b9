"""Predict the classes of image files with a trained checkpoint, preparing each image as the
training run prepared its test images (common/use/predicting.py).

    python predict.py --checkpoint FILE IMAGE_OR_FOLDER... [--top-k K] [--output preds.csv|preds.json]
"""
# The package's import comes first (this script's only one): a Ctrl-C from torch's import on ends the
# program with one line and status 130, its output never cut (common/interrupts.py).
from common.use.predicting import main

if __name__ == "__main__":
    main()
