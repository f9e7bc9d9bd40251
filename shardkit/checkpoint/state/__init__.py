"""Training state <-> FQN-keyed state dicts: model and optimizer (``state_dict``), the re-cut of a
value to another layout (``relayout``), the one nested-state walker (``tree``) and tied weights
(``aliases``).  Pure tensors and DTensors: nothing here reads or writes storage."""
