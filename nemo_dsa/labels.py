"""Label conventions shared by the data pipeline, the loss and the context-parallel sharding."""

# The label of a position without a target (a document's last token, padding): excluded from the
# loss. torch's cross_entropy ignores it by default, and nemo-automodel's collaters emit it.
IGNORE_INDEX = -100
