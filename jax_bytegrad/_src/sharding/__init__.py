"""Where the state rests: the rule that splits a leaf (``rule``), the placement objects a
data-parallel step asks (``placement``), DiLoCo's layout (``diloco``) and its fragments
(``pieces``)."""
