"""Train steps: one protocol (``base.TrainStep``) and the mechanics every algorithm shares
(the data-parallel step, accumulation, model state, loop marks and exchange); the algorithms'
own steps are in ``algorithms/``."""
