"""The accumulation core: `MultiSteps`' kinds (`accumulations`), the folds it
shares with `microbatched` (`accumulator`, `arithmetic`), `devices`, `window`,
`branch` (an inner optimizer on some steps only) and XLA's mechanisms (`xla`)."""
