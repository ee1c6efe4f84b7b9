"""Predict the classes of image files with a trained checkpoint, preparing each image as the
training run prepared its test images (common/use/predicting.py).

    python predict.py --checkpoint FILE IMAGE_OR_FOLDER... [--top-k K] [--output preds.csv|preds.json]
"""
from common.use.predicting import main

if __name__ == "__main__":
    main()
