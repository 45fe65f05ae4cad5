import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

# Each hypothesis example compiles JAX code: keep examples few and untimed.
hypothesis.settings.register_profile(
    "optax_ext", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile("optax_ext")
