"""The accumulation core: the arithmetic of a running mean (`arithmetic`),
the device view of the state (`devices`), the one conditional that runs an
inner optimizer on some steps only (`branch`) and a `MultiSteps` mini-step
built on them (`window`)."""
