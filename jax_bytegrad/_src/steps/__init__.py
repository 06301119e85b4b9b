"""Train steps: one protocol (``base.TrainStep``), one module per family of algorithms."""
