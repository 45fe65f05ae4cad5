"""The accumulation core: `MultiSteps`' kinds (`accumulations`), folds shared with
`microbatched` (`accumulator`, `arithmetic`), `devices`, `window`, `branch`, `xla`."""
