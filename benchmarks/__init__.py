"""The project's benchmarks. Most files here are scripts (`benchmarks/
README.md`); `benchmarks.step_cost` is also a module to import: a train
step's device time estimated from its deviceless compile."""
