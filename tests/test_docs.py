"""The documentation runs: every Python block of README.md and docs/*.md, the
examples in the public docstrings, and the benchmark figures the pages include;
and the hand-written API page (docs/api.md) gives the code's signatures.

Each page's ```python blocks run in page order in one namespace, as a reader
would run them (Sybil's Markdown parsers). A block that cannot run here says
so in the page with `<!-- skip: next "why" -->` in front of it; shell blocks
(```bash) are not Python and are not run. A page that needs 8 devices runs in
the multi-device process (see `test_multidevice_runner.py`).
"""

import ast
import importlib.util
import inspect
import pathlib
import re
import textwrap

import jax
import pytest
from sybil import Document, Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

import optax_ext

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
)
# Pages whose blocks build an 8-device mesh.
MULTIDEVICE_PAGES = {"docs/data_parallel.md"}
# Pages whose code calls jax.lax.pcast (jax.lax.pvary before jax 0.9).
PCAST_PAGES = {"docs/data_parallel.md"}
# Pages whose code compiles for a GPU and a TPU deviceless: run by their own
# test in that environment (test_deviceless_runner.py runs it there).
DEVICELESS_PAGES = {"docs/check_your_step.md": "test_check_your_step_doc.py"}
PARSERS = [PythonCodeBlockParser(), SkipParser()]
SKIP_DIRECTIVE = re.compile(r"<!--\s*skip:\s*(\w+)(.*?)-->")


def _page_params():
    return [
        pytest.param(
            page,
            id=page,
            marks=([pytest.mark.multidevice] if page in MULTIDEVICE_PAGES else [])
            + (
                # the page writes the current JAX API (jax.lax.pcast)
                [pytest.mark.skip(reason="jax < 0.9 has no jax.lax.pcast")]
                if page in PCAST_PAGES and not hasattr(jax.lax, "pcast")
                else []
            )
            + (
                [
                    pytest.mark.skip(
                        reason=f"compiles for a GPU and a TPU: run by "
                        f"tests/{DEVICELESS_PAGES[page]} in .venv-deviceless"
                    )
                ]
                if page in DEVICELESS_PAGES
                else []
            ),
        )
        for page in PAGES
    ]


def _relative(path: str) -> str:
    try:
        return str(pathlib.Path(path).relative_to(ROOT))
    except ValueError:
        return path


def _run_examples(document: Document) -> None:
    """Evaluates the document's examples in order, naming the failing block."""
    for example in document:
        try:
            example.evaluate()
        except Exception as error:
            raise AssertionError(
                f"the block at {_relative(example.path)}:{example.line} failed: "
                f"{type(error).__name__}: {error}"
            ) from error


@pytest.mark.parametrize("page", _page_params())
def test_python_blocks_of_page_run_in_order(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    document = Sybil(PARSERS).parse(ROOT / page)
    _run_examples(document)


def test_skipped_blocks_are_few_and_say_why():
    """A block that cannot run here (a cluster command) is marked with
    `<!-- skip: next "why" -->`; few are, and each says why."""
    skips = []
    for page in PAGES:
        for action, reason in SKIP_DIRECTIVE.findall((ROOT / page).read_text()):
            skips.append(page)
            if action == "next":
                assert reason.strip(), f"{page}: a skipped block must say why"
    assert len(skips) <= 3, f"too many skipped blocks: {skips}"


# --- docstring examples ---------------------------------------------------------

# The names a docstring example assumes, defined before it runs; `after` runs
# what the example only defines.
_COMMON = """
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import optax_ext

params = {"encoder": jnp.ones((4, 3)), "head": jnp.ones(3)}
grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
batch = jnp.linspace(-1.0, 1.0, 16 * 4).reshape(16, 4)


def loss(params, batch):
    return jnp.mean((batch @ params["encoder"] @ params["head"]) ** 2)
"""
_SETUP = {
    "apply_gradients": (
        "opt = optax.adam(1e-3)",
        "opt_state = opt.init(params)\n"
        "params, opt_state = train_step(params, opt_state, batch)",
    ),
    "inject_hyperparams": (
        "eqx_model_of_bools = {'encoder': True, 'head': False}",
        "updates, state = opt.update(grads, state, params)\n"
        "assert jnp.isclose(state.hyperparams['weight_decay'], 1e-2)",
    ),
    "microbatched": (
        "model = eqx.nn.MLP(4, 'scalar', 8, 1, key=jax.random.key(0))\n"
        "batch = (batch, jnp.ones(16))\n"
        "def loss(model, batch):\n"
        "    x, y = batch\n"
        "    return jnp.mean((jax.vmap(model)(x) - y) ** 2)",
        "assert jnp.allclose(loss, grad_fn(model, batch)[0])",
    ),
    "skip_when": (
        "state = optax.chain(\n"
        "    optax.clip_by_global_norm(1.0), optax_ext.skip_when(optax.adam(1e-3))\n"
        ").init(params)\n"
        "loss_is_spiking = jnp.asarray(True)",
        "assert all(bool((u == 0).all()) for u in jax.tree.leaves(updates))",
    ),
    "stop_gradient_where": (
        "def objective(encoder, head):\n    return jnp.sum((encoder @ head) ** 2)",
        "g = jax.grad(loss)(params, jnp.asarray(True))\n"
        "assert not g['encoder'].any() and g['head'].any()",
    ),
}


def _docstring_params():
    """Every public name, and the public methods of public classes that have
    an example."""
    params = []
    for name in optax_ext.__all__:
        obj = getattr(optax_ext, name)
        params.append(pytest.param(name, obj, id=name))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if (
                    not attr.startswith("_")
                    and callable(member)
                    and "```python" in (inspect.getdoc(member) or "")
                ):
                    params.append(
                        pytest.param(f"{name}.{attr}", member, id=f"{name}.{attr}")
                    )
    return params


@pytest.mark.parametrize("name, obj", _docstring_params())
def test_docstring_examples_run(name, obj):
    docstring = inspect.getdoc(obj) or ""
    if "```python" not in docstring:
        pytest.skip(f"{name}'s docstring has no Python example")
    setup, after = _SETUP.get(name, ("", ""))
    document = Document(docstring, f"optax_ext.{name}")
    namespace = document.namespace
    namespace["__name__"] = f"docstring_of_{name}"
    exec(compile(_COMMON + setup, f"<setup for {name}>", "exec"), namespace)
    for parser in PARSERS:
        for region in parser(document):
            document.add(region)
    _run_examples(document)
    if after:
        exec(compile(textwrap.dedent(after), f"<after {name}>", "exec"), namespace)


# --- benchmark figures included from benchmarks/results/ ----------------------


def _sync_docs():
    spec = importlib.util.spec_from_file_location(
        "sync_docs", ROOT / "docs" / "sync_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_included_results_equal_the_results_files():
    """Each `<!-- results: FILE -->` include in README.md and docs/*.md holds
    FILE's current text; refresh with `python docs/sync_docs.py`."""
    sync_docs = _sync_docs()
    assert sync_docs.pages() == [ROOT / page for page in PAGES]
    included = [
        match["target"]
        for page in PAGES
        for match in sync_docs.INCLUDE.finditer((ROOT / page).read_text())
    ]
    assert included, "no page includes a results file"
    assert sync_docs.stale_pages() == [], (
        "run `python docs/sync_docs.py` to refresh the included results"
    )


def test_sync_docs_finds_and_refreshes_a_stale_include(tmp_path):
    sync_docs = _sync_docs()
    (tmp_path / "docs").mkdir()
    (tmp_path / "results.md").write_text(
        "Machine: x.\n\n## Step time\n\n| a |\n|---|\n| 2.0 |\n\n## Memory\n\n3 MiB\n"
    )
    page = tmp_path / "README.md"
    page.write_text(
        "Intro.\n\n<!-- results: results.md#step-time -->\n| a |\n|---|\n| 1.0 |\n"
        "<!-- /results -->\n\n<!-- results: results.md -->\n<!-- /results -->\n"
    )
    assert sync_docs.stale_pages(tmp_path) == [
        "README.md: results.md#step-time, results.md"
    ]
    page.write_text(sync_docs.synced(page.read_text(), tmp_path))
    assert sync_docs.stale_pages(tmp_path) == []
    text = page.read_text()
    assert "| 2.0 |" in text and "| 1.0 |" not in text
    # The section stops at the next heading of its level.
    section = text.split("#step-time -->")[1].split("<!-- /results -->")[0]
    assert "3 MiB" not in section
    with pytest.raises(FileNotFoundError, match="missing.md"):
        sync_docs.synced("<!-- results: missing.md -->\n<!-- /results -->", tmp_path)
    with pytest.raises(KeyError, match="no-such"):
        sync_docs.synced(
            "<!-- results: results.md#no-such -->\n<!-- /results -->", tmp_path
        )


def _figures_not_in_results(section: str) -> list[str]:
    """The figures of a hand-written section that no file of
    benchmarks/results/ holds. A figure may carry a unit "x" (a ratio):
    "1.975x" is looked up as "1.975"."""
    results = "\n".join(
        p.read_text() for p in sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    )
    figures = re.findall(r"(?<![\w.])(\d+\.\d+)x?(?!\w|\.\d)", section)
    assert len(figures) >= 10, figures
    return [
        f
        for f in figures
        if not re.search(rf"(?<![\w.]){re.escape(f)}x?(?!\w|\.\d)", results)
    ]


def test_readme_performance_figures_come_from_the_results_files():
    """The README's table of forms ("Which form to use") is written by
    hand (short, terms defined); every figure in it must still appear in a
    file of benchmarks/results/, so a new benchmark run that changes one
    fails here until the README is updated."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Which form to use\n", 1)[1].split("\n## ", 1)[0]
    missing = _figures_not_in_results(section)
    assert missing == [], (
        f"README's performance figures not in benchmarks/results/*.md: {missing}"
    )


def test_whole_step_figures_of_the_performance_page_come_from_the_results():
    """The same for docs/performance.md's per-backend tables of the whole
    train step (its open cases give the figures the tests measure)."""
    page = (ROOT / "docs" / "performance.md").read_text()
    section = page.split("\n## The whole train step against optax.MultiSteps\n")[1]
    section = section.split("\n### Open cases\n", 1)[0]
    missing = _figures_not_in_results(section)
    assert missing == [], (
        f"docs/performance.md's whole-step figures not in benchmarks/results/: "
        f"{missing}"
    )


def test_opening_figures_of_the_performance_page_come_from_the_results():
    """The same for docs/performance.md's first screen (what each form
    gains per kind of model and backend), written by hand."""
    page = (ROOT / "docs" / "performance.md").read_text()
    section = page.split("\n## The whole train step against optax.MultiSteps\n")[0]
    missing = _figures_not_in_results(section)
    assert missing == [], (
        f"docs/performance.md's opening figures not in benchmarks/results/: {missing}"
    )


# The performance page's names of whole_step.py's cases.
WHOLE_STEP_MODELS = {
    "MLP": "mlp 4 x (2048, 2048), batch 8",
    "GPT-2-like": "gpt2-like, 2 layers of width 256",
    "wider GPT-2-like": "gpt2-like, 6 layers of width 512, sequence 128",
    "decoder": "gpt2-like decoder, 4 layers of width 256, sequence 128, batch 8",
}
WHOLE_STEP_FORMS = ["optax", "drop-in", "fused", "emit=False", "emit=True", "bare"]
# The files whose memory tables (`| backend | model | ...`) whole_step.py
# writes: `--cases default` and `--cases decoder`.
WHOLE_STEP_FILES = ["whole_step.md", "whole_step_transformer.md"]


def _whole_step_rows() -> dict[tuple[str, ...], dict[str, str]]:
    """The rows of whole_step.py's memory tables in WHOLE_STEP_FILES:
    (backend, model, dtype, inner) to each form's figure."""
    rows = {}
    for name in WHOLE_STEP_FILES:
        header = None
        for line in (ROOT / "benchmarks" / "results" / name).read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("|"):
                header = None  # a table's end
                continue
            if cells[0] == "backend":
                header = cells
                continue
            if header is None or set(cells[0]) <= set("- "):
                continue
            assert tuple(cells[:4]) not in rows, f"{name}: {cells[:4]} twice"
            rows[tuple(cells[:4])] = dict(zip(header[4:], cells[4:], strict=True))
    return rows


def _performance_whole_step_cells():
    """Each figure of docs/performance.md's per-backend whole-step tables,
    as (its row's key in whole_step.md, the form, the figure)."""
    page = (ROOT / "docs" / "performance.md").read_text()
    section = page.split("\n## The whole train step against optax.MultiSteps\n")[1]
    section = section.split("\n### Open cases\n", 1)[0]
    backend, columns = None, None
    for line in section.splitlines():
        heading = re.match(r"### (XLA:CPU|H200|TPU v5e)", line)
        if heading:
            backend = {"XLA:CPU": None, "H200": "H200"}.get(heading[1], "TPU v5e")
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            columns = None  # a table's end
        elif cells[0] == "case":
            columns = cells
        elif columns and not set(cells[0]) <= set("-"):
            row = dict(zip(columns, cells, strict=True))
            model, dtype, inner, *acc = (c.strip() for c in row["case"].split(","))
            if acc:
                inner += ", " + acc[0].strip("`")
            name = backend or f"XLA:CPU (jax {row['jax']})"
            key = (name, WHOLE_STEP_MODELS[model], dtype, inner)
            for form in WHOLE_STEP_FORMS:
                yield key, form, row[form if form != "optax" else "optax.MultiSteps"]


def test_whole_step_tables_of_the_performance_page_equal_the_results():
    """Cell by cell: each figure of docs/performance.md's per-backend
    whole-step tables is the figure of that backend, JAX, case and form in
    benchmarks/results/whole_step.md or whole_step_transformer.md (a
    figure that is merely somewhere in the results, the check above, can
    be another case's)."""
    rows = _whole_step_rows()
    cells = list(_performance_whole_step_cells())
    # Every row of whole_step.md is on the page, each form of it once.
    assert sorted(key for key, _, _ in cells) == sorted(
        key for key in rows for _ in WHOLE_STEP_FORMS
    )
    wrong = [
        (key, form, figure, rows.get(key, {}).get(form))
        for key, form, figure in cells
        if rows.get(key, {}).get(form) != figure
    ]
    assert wrong == [], wrong


# --- sentences a reader can take in ---------------------------------------

# The pages held to the aim of issue 40: sentences averaging under 18 words,
# none over 40 (Optax's README averages about 13, Equinox's about 9).
SHORT_PAGES = [
    "README.md",
    "docs/multi_steps.md",
    "docs/microbatched.md",
    "docs/performance.md",
    "docs/check_your_step.md",
]
# A sentence ends at `.`, `:` or `;` before what can start one (not `e.g.
# x`, a decimal or `XLA:CPU`), and at a list item.
SENTENCE_END = re.compile(r"(?<=[.:;])\s+(?=[A-Z`*\[(\"])")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+(.*)$")


def prose_sentences(text: str) -> list[list[str]]:
    """The page's sentences as lists of words, prose only: code blocks,
    indented blocks, tables, headings, HTML comments and the text included
    from benchmarks/results/ (the benchmarks write it) are left out. A word
    is a whitespace-separated token with a letter or digit in it."""
    text = _sync_docs().INCLUDE.sub("", text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    paragraphs: list[list[str]] = [[]]
    fenced = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            paragraphs.append([])
        elif fenced or not stripped or stripped[0] in "#|" or line.startswith("    "):
            paragraphs.append([])
        elif item := LIST_ITEM.match(line):
            paragraphs.append([item.group(1)])
        else:
            paragraphs[-1].append(stripped)
    sentences = []
    for paragraph in paragraphs:
        for sentence in SENTENCE_END.split(" ".join(paragraph)):
            words = [w for w in sentence.split() if re.search(r"\w", w)]
            if words:
                sentences.append(words)
    return sentences


def sentence_figures(page: str) -> tuple[int, float, int, int]:
    """(sentences, average words, sentences over 40 words, longest)."""
    lengths = [len(s) for s in prose_sentences((ROOT / page).read_text())]
    return (
        len(lengths),
        sum(lengths) / len(lengths),
        sum(n > 40 for n in lengths),
        max(lengths),
    )


def test_sentence_counter_splits_as_a_reader_does():
    text = (
        "# A heading is left out\n\nOne sentence ends here. `code` starts "
        "the next: XLA:CPU, 0.264x and e.g. this do not end it; Another one.\n"
        "\n| a table | is left out. |\n\n```python\nx = 1. Not prose.\n```\n"
        "\n- a list item\n  goes on\n- another\n<!-- a comment. -->\n"
        "<!-- results: x.md -->\nWritten by a benchmark.\n<!-- /results -->\n"
    )
    assert [" ".join(s) for s in prose_sentences(text)] == [
        "One sentence ends here.",
        "`code` starts the next:",
        "XLA:CPU, 0.264x and e.g. this do not end it;",
        "Another one.",
        "a list item goes on",
        "another",
    ]


@pytest.mark.parametrize("page", SHORT_PAGES)
def test_page_sentences_average_under_18_words_none_over_40(page):
    """`python tests/test_docs.py` prints the figures of every page."""
    count, average, long, longest = sentence_figures(page)
    over = [
        " ".join(s) for s in prose_sentences((ROOT / page).read_text()) if len(s) > 40
    ]
    assert average < 18 and not over, (
        f"{page}: {count} sentences, {average:.1f} words on average, "
        f"{long} over 40 (longest {longest}): {over}"
    )


def test_readme_prose_names_no_test():
    """Test names belong in the tables and the docs, not in the README's
    sentences."""
    prose = [" ".join(s) for s in prose_sentences((ROOT / "README.md").read_text())]
    named = [s for s in prose if re.search(r"\btest_\w+", s)]
    assert named == []


# --- the API page and the list of pages ---------------------------------------


# A signature on the API page: a ```text block holding `optax_ext.NAME(...)`
# or `Class.method(...)`, with an optional `-> return annotation`.
SIGNATURE_BLOCK = re.compile(
    r"^```text\n(?P<name>(?:optax_ext\.)?\w+(?:\.\w+)?)(?P<rest>\(.*?)\n```\n"
    r"\n(?P<summary>\S[^\n]*)",
    re.DOTALL | re.MULTILINE,
)
# Names a written default may use.
_DEFAULT_NAMES = {"jax": jax, "jnp": jax.numpy}


def _public_callables() -> dict[str, object]:
    """`NAME` for every public name, and `Class.method` for the public
    methods of public classes: what the API page must give a signature for."""
    found = {}
    for name in optax_ext.__all__:
        obj = getattr(optax_ext, name)
        found[name] = obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    found[f"{name}.{attr}"] = member
    return found


def _annotation(text: str | None) -> str | None:
    """An annotation's source text, normalised by `ast`."""
    return None if text is None else ast.unparse(ast.parse(text, mode="eval"))


def _source_annotations(obj) -> dict[str, str | None]:
    """Each parameter's annotation (and `->`'s) as the source writes it: the
    package's annotations are evaluated at import, so `inspect` would give
    objects (`jax.jaxlib._jax.Array`), not the names a reader sees."""
    if inspect.isclass(obj) and "__init__" not in vars(obj):  # NamedTuple fields
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(obj))).body
        fields = [f for f in node.body if isinstance(f, ast.AnnAssign)]
        return {f.target.id: ast.unparse(f.annotation) for f in fields}
    function = obj.__init__ if inspect.isclass(obj) else obj
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(function))).body
    args = node.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    found = {a.arg: ast.unparse(a.annotation) for a in every if a and a.annotation}
    return {**found, "->": ast.unparse(node.returns) if node.returns else None}


def _code_signature(name: str, obj) -> list:
    """(parameter name, kind, annotation, default) for each parameter, then
    the return annotation: what the code says."""
    parameters = list(inspect.signature(obj).parameters.values())
    if "." in name:  # a method: drop `self`
        parameters = parameters[1:]
    written = _source_annotations(obj)
    described = [
        (
            p.name,
            p.kind,
            _annotation(written.get(p.name)),
            "<none>" if p.default is inspect.Parameter.empty else p.default,
        )
        for p in parameters
    ]
    returns = None if inspect.isclass(obj) else written.get("->")
    return [*described, ("->", _annotation(returns))]


def _written_signature(rest: str) -> list:
    """The same description, parsed from the page's `(...) -> ...`."""
    (function,) = ast.parse(f"def f{rest}: ...").body
    args = function.args
    kind = inspect.Parameter
    positional = [(a, kind.POSITIONAL_ONLY) for a in args.posonlyargs] + [
        (a, kind.POSITIONAL_OR_KEYWORD) for a in args.args
    ]
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    entries = list(zip(positional, defaults, strict=True))
    if args.vararg:
        entries.append(((args.vararg, kind.VAR_POSITIONAL), None))
    entries += [
        ((a, kind.KEYWORD_ONLY), d)
        for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        entries.append(((args.kwarg, kind.VAR_KEYWORD), None))
    described = [
        (
            arg.arg,
            k,
            ast.unparse(arg.annotation) if arg.annotation else None,
            "<none>"
            if default is None
            else eval(ast.unparse(default), dict(_DEFAULT_NAMES)),
        )
        for (arg, k), default in entries
    ]
    returns = ast.unparse(function.returns) if function.returns else None
    return [*described, ("->", returns)]


def _api_page_signatures() -> dict[str, re.Match]:
    text = (ROOT / "docs" / "api.md").read_text()
    written = {}
    for match in SIGNATURE_BLOCK.finditer(text):
        name = match["name"].removeprefix("optax_ext.")
        assert name not in written, f"docs/api.md gives {name} twice"
        written[name] = match
    return written


def test_api_page_gives_every_public_name_with_its_signature():
    """docs/api.md, readable without mkdocs, writes each public name's (and
    public method's) signature by hand, followed by a summary: each must
    equal the code's (names, kinds, annotations, defaults, return
    annotation), and nothing else may be documented there."""
    written = _api_page_signatures()
    expected = _public_callables()
    assert sorted(written) == sorted(expected), (
        "docs/api.md must give a signature for exactly the public names and "
        f"methods: missing {sorted(set(expected) - set(written))}, "
        f"not public {sorted(set(written) - set(expected))}"
    )
    for name, obj in expected.items():
        match = written[name]
        assert _written_signature(match["rest"]) == _code_signature(name, obj), (
            f"docs/api.md: the signature of {name} differs from the code's "
            f"{inspect.signature(obj)}"
        )
        assert match["summary"].strip(), f"docs/api.md: {name} has no summary"


def test_api_page_signature_check_sees_a_wrong_default_or_annotation():
    """The comparison above is not blind: a changed default, annotation,
    kind or parameter name reads as a difference."""
    code = _code_signature("skip_when", optax_ext.skip_when)
    right = (
        "(inner: optax.GradientTransformation, flag: str = 'skip')"
        " -> optax.GradientTransformationExtraArgs"
    )
    assert _written_signature(right) == code
    for wrong in [
        right.replace("'skip'", "'skip_'"),
        right.replace("flag: str", "flag: bool"),
        right.replace("flag", "name"),
        right.replace("(inner", "(*, inner"),
        right.replace(" -> optax.GradientTransformationExtraArgs", ""),
    ]:
        assert _written_signature(wrong) != code, wrong
    # A default written as an expression (`jnp.float32`) is evaluated.
    code = _code_signature("MultiSteps", optax_ext.MultiSteps)
    page = _api_page_signatures()["MultiSteps"]["rest"]
    assert _written_signature(page) == code
    assert _written_signature(page.replace("jnp.float32", "jnp.bfloat16")) != code


def test_reference_page_renders_every_public_name():
    """docs/reference.md holds the mkdocstrings directive of every public
    name (the site renders their docstrings there), each after a line that
    names the source file holding the docstring: read outside the site
    (on GitHub), the directives alone showed nothing."""
    text = (ROOT / "docs" / "reference.md").read_text()
    documented = re.findall(r"^::: optax_ext\.(\w+)$", text, re.MULTILINE)
    assert sorted(documented) == sorted(optax_ext.__all__)
    for name in documented:
        source = pathlib.Path(inspect.getsourcefile(getattr(optax_ext, name)))
        where = str(source.resolve().relative_to(ROOT))
        pointer = (
            f"`optax_ext.{name}`: docstring in `{where}`.\n\n::: optax_ext.{name}\n"
        )
        assert pointer in text, f"docs/reference.md: {name} lacks {pointer!r}"


def test_readme_and_site_nav_list_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README does not link {page.name}"
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.MULTILINE), (
            f"mkdocs.yml nav lacks {page.name}"
        )


if __name__ == "__main__":
    for page in PAGES:
        count, average, long, longest = sentence_figures(page)
        print(
            f"{page}: {count} sentences, {average:.1f} words on average, "
            f"{long} over 40, longest {longest}"
        )
