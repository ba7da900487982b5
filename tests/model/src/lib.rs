//! Nothing here: the model checks are in `tests/`.
