"""Reading data: data sets held as uint8 tensors, the training loader and the exact evaluation
shards (loader), the data sets' on-disk formats (formats), and getting a data set onto every node
(fetch: local files, a download or an object-store copy, once per node).

May import: the base at the top of common/ and parallel/ (fetch waits for the other nodes through the
job's store). Never output/ or train/: reading data knows nothing of the loop or of what a run
reports.
"""
