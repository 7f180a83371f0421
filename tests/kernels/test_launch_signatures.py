"""Every Triton launch in our code matches the parameters of the @triton.jit kernel it launches, checked on the CPU.

A launch `kernel[grid](a, b, X=..., BLOCK=...)` (or `kernel.warmup(..., grid=...)`) whose arguments no longer fit
the kernel fails only on a GPU. This test reads the source with `ast` alone (triton is never imported) and checks,
for each launch of a kernel defined under `SCANNED`:

  (a) every keyword is a parameter of the kernel or a launch option (`launch_options`);
  (b) the positional arguments and the keywords cover every parameter without a default;
  (c) no parameter is given twice (a repeated keyword, or a keyword for a parameter filled positionally), and
      there are no more positional arguments than parameters;
  (d) `**pdl.options(x)` goes only to kernels with the parameter(s) it fills (`PDL`).

What the launched name, a `*starred` argument or a `**mapping` stands for is resolved statically: a kernel defined
in the module or imported from one of ours, a local alias (`kernel = a if x else b`, a dict of kernels indexed, a
default argument), a parameter of a module-level helper bound at each of the helper's calls in the module (so
`_launch(_rms_norm_kernel, x, eps, *extra)` is checked once per call with its extra arguments), tuple literals and
`tuple(... for t in (q, k, v))`, `*t.stride()` by `t`'s rank (a `torch.empty/zeros/...` shape, or a docstring's
`t [a, b, c]`), `dict(K=...)` and dict literals, and our functions returning dict literals (`pdl.options`).
A launch that cannot be resolved this way must be listed in `UNEXPLAINED` with a reason; the test asserts the list
equals what it finds, so it cannot grow silently.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("hybridcache", "benchmarks", "scripts")

# (file, enclosing function, launched expression) -> why the launch is not checked (or only partly).
UNEXPLAINED = {
    ("hybridcache/kernels/mamba2/fla.py", "simple_gla_varlen", "kernels.chunk_h.chunk_fwd_kernel_h"):
        "fla-core's kernel (pyproject `cuda` extra pins 0.6), not ours: its parameters live in the fla package",
    ("hybridcache/kernels/mamba2/fla.py", "simple_gla_varlen", "kernels.chunk_o.chunk_fwd_kernel_o"):
        "fla-core's kernel (pyproject `cuda` extra pins 0.6), not ours: its parameters live in the fla package",
    ("benchmarks/fp8_sweep.py", "timed_cuda", "calls"):
        "`calls[i]()` runs the benchmark's closures (a list passed down from `timed`), not a kernel",
    ("hybridcache/kernels/parallel_compile.py", "_warming_first", "self"):
        "any autotuned kernel's `Autotuner.warmup`, forwarding the launch's own arguments (fla's kernels), not ours",
}

# Launch options when triton's source cannot be found (those of triton 3.x's CUDAOptions that a launch may set).
FALLBACK_OPTIONS = frozenset({"num_warps", "num_ctas", "num_stages", "maxnreg", "enable_fp_fusion",
                              "launch_cooperative_grid", "launch_pdl", "debug", "sanitize_overflow"})
_CREATORS = {"empty", "zeros", "ones", "randn", "rand", "full", "randint", "new_empty", "new_zeros"}


def launch_options() -> frozenset[str]:
    """The keywords triton's launcher takes besides a kernel's parameters: the fields of the NVIDIA backend's
    `CUDAOptions` (what `JITFunction._pack_args` accepts), read from triton's source without importing it."""
    spec = importlib.util.find_spec("triton")  # a top-level name: located, not imported
    if spec is None or not spec.submodule_search_locations:
        return FALLBACK_OPTIONS
    source = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia" / "compiler.py"
    if not source.exists():
        return FALLBACK_OPTIONS
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "CUDAOptions":
            return frozenset(s.target.id for s in node.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return FALLBACK_OPTIONS


@dataclass(frozen=True)
class Kernel:
    """A @triton.jit function: its parameters in order and those without a default."""

    path: str
    name: str
    params: tuple[str, ...]
    required: frozenset[str]


@dataclass(eq=False)  # hashed by identity
class Module:
    """One parsed file: its kernels, module-level functions and imports (local name -> dotted targets)."""

    path: str
    dotted: str
    tree: ast.Module
    mentions_triton: bool
    kernels: dict[str, Kernel] = field(default_factory=dict)
    kernel_defs: list[ast.FunctionDef] = field(default_factory=list)
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    imports: dict[str, set[str]] = field(default_factory=dict)
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)


class Unresolved(Exception):
    """What an expression stands for cannot be told from the source."""


@dataclass(frozen=True)
class Scope:
    """Where an expression is evaluated: its module, enclosing functions (outermost first) and, for a helper's
    body inlined at one of its calls, what its parameters are bound to there."""

    module: Module
    chain: tuple[ast.FunctionDef, ...]
    bound: tuple[tuple[str, object], ...] = ()  # name -> (expr, Scope) or, for *varargs, [(expr, Scope), ...]

    def binding(self, name: str) -> object | None:
        return dict(self.bound).get(name)


@dataclass
class Launch:
    """One launch as checked against one kernel it may launch (once per helper call when inlined)."""

    where: str
    kernel: Kernel
    num_positional: int  # starred arguments counted
    min_positional: int  # starred arguments left out
    keywords: list[str]
    sure_keywords: set[str]  # keywords given on every path (a ** mapping may give some only on some)
    mapping_keys: dict[str, set[str]]  # `**f(...)` source -> the parameters it fills (launch options left out)


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("triton.jit", "jit")


def _dotted_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def parse(sources: dict[str, str]) -> dict[str, Module]:
    """Parse files (path -> source) into Modules keyed by dotted name."""
    modules = {}
    for path, source in sources.items():
        module = Module(path, _dotted_name(path), ast.parse(source), "triton" in source)
        for node in ast.walk(module.tree):
            for child in ast.iter_child_nodes(node):
                module.parents[child] = node
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                _add_import(module, node)
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                args = node.args
                if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs:
                    raise AssertionError(f"{path}: kernel {node.name} has a signature this test does not model")
                names = [a.arg for a in args.args]
                module.kernel_defs.append(node)
                module.kernels[node.name] = Kernel(path, node.name, tuple(names),
                                                   frozenset(names[:len(names) - len(args.defaults)]))
            elif isinstance(node, ast.FunctionDef):
                module.functions[node.name] = node
        modules[module.dotted] = module
    return modules


def _add_import(module: Module, node: ast.Import | ast.ImportFrom) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            local = alias.asname or alias.name.split(".")[0]
            module.imports.setdefault(local, set()).add(alias.name if alias.asname else local)
        return
    base = node.module or ""
    if node.level:
        package = module.dotted.split(".")
        package = package[:len(package) - node.level + (module.path.endswith("__init__.py"))]
        base = ".".join(package + ([base] if base else []))
    for alias in node.names:
        module.imports.setdefault(alias.asname or alias.name, set()).add(f"{base}.{alias.name}")


def _lookup_dotted(dotted: str, modules: dict[str, Module], depth: int = 0) -> set[object]:
    """What a dotted name of ours stands for: a Module, a Kernel or a FunctionDef (with its module)."""
    if dotted in modules:
        return {modules[dotted]}
    owner, _, attr = dotted.rpartition(".")
    if owner not in modules:
        bare = dotted.split(".", 1)  # benchmarks import each other by file name
        if f"benchmarks.{bare[0]}" in modules and len(bare) > 1:
            return _lookup_dotted(f"benchmarks.{dotted}", modules, depth)
        raise Unresolved(dotted)
    module = modules[owner]
    if attr in module.kernels:
        return {module.kernels[attr]}
    if attr in module.functions:
        return {(module, module.functions[attr])}
    if attr in module.imports and depth < 4:
        return set().union(*(_lookup_dotted(t, modules, depth + 1) for t in module.imports[attr]))
    raise Unresolved(dotted)


def _assignments(function: ast.AST, name: str) -> list[ast.expr]:
    """Values assigned to `name` directly in `function`'s body (not in nested functions); Unresolved if it is
    also bound some other way (a loop, a tuple target, augmented assignment)."""
    values = []
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == name:
                    values.append(node.value)
                elif any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                    raise Unresolved(name)
        elif isinstance(node, (ast.For, ast.AugAssign, ast.AnnAssign, ast.NamedExpr, ast.With, ast.comprehension)):
            target = node.target if not isinstance(node, ast.With) else ast.Tuple(
                [i.optional_vars for i in node.items if i.optional_vars], ast.Load())
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                raise Unresolved(name)
        stack.extend(ast.iter_child_nodes(node))
    return values


def _name_values(name: str, scope: Scope) -> list[tuple[ast.expr, Scope]]:
    """The expressions (with their scopes) a name may stand for, innermost function first; [] for a global."""
    bound = scope.binding(name)
    if bound is not None:
        if isinstance(bound, list):
            raise Unresolved(f"*{name}")
        return [bound]
    for depth in range(len(scope.chain) - 1, -1, -1):
        function = scope.chain[depth]
        outer = Scope(scope.module, scope.chain[:depth], scope.bound)
        args = function.args
        positional = args.posonlyargs + args.args
        defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
        defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
        if name in defaults:
            return [(defaults[name], outer)]
        if name in {a.arg for a in positional + args.kwonlyargs} or name in (
                args.vararg and args.vararg.arg, args.kwarg and args.kwarg.arg):
            raise Unresolved(name)  # a parameter not bound by inlining
        values = _assignments(function, name)
        if values:
            return [(v, Scope(scope.module, scope.chain[:depth + 1], scope.bound)) for v in values]
    return []


def resolve(expr: ast.expr, scope: Scope, modules: dict[str, Module]) -> set[object]:
    """What a launched expression may be: Kernels, and other things of ours (modules, functions)."""
    if isinstance(expr, ast.IfExp):
        return resolve(expr.body, scope, modules) | resolve(expr.orelse, scope, modules)
    if isinstance(expr, ast.Subscript):
        found = set()
        for value, where in _values_of(expr.value, scope, modules):
            if not isinstance(value, ast.Dict) or None in value.keys:
                raise Unresolved(ast.unparse(expr))
            for item in value.values:
                found |= resolve(item, where, modules)
        return found
    if isinstance(expr, (ast.Dict, ast.List, ast.ListComp, ast.Tuple, ast.Lambda, ast.Constant)):
        return {expr}  # not a kernel: a dict of functions, a list of closures
    if isinstance(expr, ast.Name):
        values = _name_values(expr.id, scope)
        if values:
            return set().union(*(resolve(v, s, modules) for v, s in values))
        module = scope.module
        if expr.id in module.kernels:
            return {module.kernels[expr.id]}
        if expr.id in module.functions:
            return {(module, module.functions[expr.id])}
        if expr.id in module.imports:
            return set().union(*(_lookup_dotted(t, modules) for t in module.imports[expr.id]))
        raise Unresolved(expr.id)
    if isinstance(expr, ast.Attribute):
        found = set()
        for owner in resolve(expr.value, scope, modules):
            if not isinstance(owner, Module):
                raise Unresolved(ast.unparse(expr))
            found |= _lookup_dotted(f"{owner.dotted}.{expr.attr}", modules)
        return found
    raise Unresolved(ast.unparse(expr))


def _values_of(expr: ast.expr, scope: Scope, modules: dict[str, Module]) -> list[tuple[ast.expr, Scope]]:
    """An expression followed through local names to the expressions that define it."""
    if isinstance(expr, ast.Name):
        values = _name_values(expr.id, scope)
        if not values:
            raise Unresolved(expr.id)
        return [pair for v, s in values for pair in _values_of(v, s, modules)]
    return [(expr, scope)]


def _rank(expr: ast.expr, scope: Scope, modules: dict[str, Module]) -> int:
    """A tensor's rank: from `torch.empty(a, b, c)` (or a shape tuple), else a docstring's `name [a, b, c]`."""
    if isinstance(expr, ast.Name):
        try:
            values = _name_values(expr.id, scope)
        except Unresolved:  # a parameter: its docstring tells
            values = []
        if values:
            ranks = {_rank(v, s, modules) for v, s in values}
            if len(ranks) == 1:
                return ranks.pop()
            raise Unresolved(f"rank of {expr.id}")
        for node in [*reversed(scope.chain), scope.module.tree]:
            doc = ast.get_docstring(node) or ""
            match = re.search(rf"(?<![\w.]){re.escape(expr.id)} \[([^\]]*)\]", doc)
            if match and "..." not in match.group(1):
                return match.group(1).count(",") + 1
        raise Unresolved(f"rank of {expr.id}")
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in _CREATORS:
        dims = expr.args[1:] if expr.func.attr == "full" else expr.args
        if expr.func.attr == "randint":
            dims = [a for a in expr.args if isinstance(a, (ast.Tuple, ast.List))]
        if len(dims) == 1 and isinstance(dims[0], (ast.Tuple, ast.List)):
            dims = dims[0].elts
        if dims and not any(isinstance(d, ast.Starred) for d in dims):
            return len(dims)
    raise Unresolved(f"rank of {ast.unparse(expr)}")


def _length(expr: ast.expr, scope: Scope, modules: dict[str, Module]) -> int:
    """How many arguments `*expr` gives."""
    if isinstance(expr, ast.Name):
        bound = scope.binding(expr.id)
        if isinstance(bound, list):
            return len(bound)
        lengths = {_length(v, s, modules) for v, s in _values_of(expr, scope, modules)}
        if len(lengths) == 1:
            return lengths.pop()
    elif isinstance(expr, (ast.Tuple, ast.List)):
        return sum(_length(e.value, scope, modules) if isinstance(e, ast.Starred) else 1 for e in expr.elts)
    elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("tuple", "list") \
            and len(expr.args) == 1 and isinstance(expr.args[0], (ast.GeneratorExp, ast.ListComp)):
        generators = expr.args[0].generators
        if len(generators) == 1 and not generators[0].ifs:
            return _length(generators[0].iter, scope, modules)
    elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr in ("stride", "size") \
            and not expr.args:
        return _rank(expr.func.value, scope, modules)
    elif isinstance(expr, ast.Attribute) and expr.attr == "shape":
        return _rank(expr.value, scope, modules)
    raise Unresolved(f"*{ast.unparse(expr)}")


def _mapping_keys(expr: ast.expr, scope: Scope, modules: dict[str, Module]) -> list[set[str]]:
    """The key sets `**expr` may give, one per path (a function returning different dict literals)."""
    if isinstance(expr, ast.Dict) and all(isinstance(k, ast.Constant) for k in expr.keys):
        return [{k.value for k in expr.keys}]
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict" \
            and not expr.args and all(k.arg for k in expr.keywords):
        return [{k.arg for k in expr.keywords}]
    if isinstance(expr, ast.Name):
        values = _values_of(expr, scope, modules)
        if len(values) == 1:
            return _mapping_keys(*values[0], modules)
    if isinstance(expr, ast.Call):
        paths = []
        for target in resolve(expr.func, scope, modules):
            if not isinstance(target, tuple):
                raise Unresolved(ast.unparse(expr))
            module, function = target
            returns = [n.value for n in ast.walk(function) if isinstance(n, ast.Return)]
            inner = Scope(module, (function,))
            for value in returns:
                for branch in (value.body, value.orelse) if isinstance(value, ast.IfExp) else (value,):
                    paths += _mapping_keys(branch, inner, modules)
        if paths:
            return paths
    raise Unresolved(f"**{ast.unparse(expr)}")


def _enclosing(node: ast.AST, module: Module) -> tuple[ast.FunctionDef, ...]:
    chain = []
    while node in module.parents:
        node = module.parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            chain.append(node)
    return tuple(reversed(chain))


def _helper_scopes(chain: tuple[ast.FunctionDef, ...], call: ast.Call, module: Module) -> list[Scope]:
    """The scopes to check a launch in: as written, or, when it launches a parameter of its module-level helper or
    stars the helper's *varargs, once per call of the helper in the module with its parameters bound there."""
    plain = [Scope(module, chain)]
    if not chain or chain[0].name not in module.functions:
        return plain
    helper = chain[0]
    params = [a.arg for a in helper.args.args]
    vararg = helper.args.vararg.arg if helper.args.vararg else None
    starred = {a.value.id for a in call.args if isinstance(a, ast.Starred) and isinstance(a.value, ast.Name)}
    base = call.func.value
    if not (isinstance(base, ast.Name) and base.id in params) and (vararg is None or vararg not in starred):
        return plain
    scopes = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == helper.name:
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise Unresolved(f"call of {helper.name} at line {node.lineno}")
            caller = Scope(module, _enclosing(node, module))
            bound = [(p, (a, caller)) for p, a in zip(params, node.args)]
            if vararg:
                bound.append((vararg, [(a, caller) for a in node.args[len(params):]]))
            scopes.append(Scope(module, chain, tuple(bound)))
    return scopes or plain


def find_launches(modules: dict[str, Module]) -> tuple[list[Launch], dict[tuple[str, str, str], str]]:
    """Every launch of one of our kernels, and the launches that could not be resolved (key -> what failed)."""
    launches, unexplained = [], {}
    for module in modules.values():
        for call in ast.walk(module.tree):
            if not isinstance(call, ast.Call):
                continue
            if isinstance(call.func, ast.Subscript):
                base, extra_options = call.func.value, set()
            elif isinstance(call.func, ast.Attribute) and call.func.attr == "warmup":
                base, extra_options = call.func.value, {"grid"}
            else:
                continue
            chain = _enclosing(call, module)
            key = (module.path, chain[0].name if chain else "", ast.unparse(base))
            try:
                for scope in _helper_scopes(chain, call, module):
                    targets = resolve(base, scope, modules)
                    if not any(isinstance(t, Kernel) for t in targets):
                        continue  # a dict of functions, a list: not a launch
                    if not all(isinstance(t, Kernel) for t in targets):
                        raise Unresolved(f"{ast.unparse(base)} is a kernel on some paths only")
                    launch = _arguments(call, scope, modules, f"{module.path}:{call.lineno}")
                    for kernel in targets:
                        launches.append(Launch(kernel=kernel, **launch))
                        launches[-1].keywords = [k for k in launches[-1].keywords if k not in extra_options]
            except Unresolved as error:
                if module.mentions_triton or "kernel" in key[2].lower():
                    unexplained[key] = str(error)
    return launches, unexplained


def _arguments(call: ast.Call, scope: Scope, modules: dict[str, Module], where: str) -> dict:
    """A launch's positional count, keywords (those of `**` mappings included) and where each mapping came from."""
    minimum = sum(1 for a in call.args if not isinstance(a, ast.Starred))
    count = minimum + sum(_length(a.value, scope, modules) for a in call.args if isinstance(a, ast.Starred))
    keywords = [k.arg for k in call.keywords if k.arg]
    sure, mapping_keys = set(keywords), {}
    for item in call.keywords:
        if item.arg is None:
            paths = _mapping_keys(item.value, scope, modules)
            keywords += sorted(set().union(*paths))
            sure |= set.intersection(*paths)
            if isinstance(item.value, ast.Call):
                mapping_keys[ast.unparse(item.value)] = set().union(*paths)
    return dict(where=where, num_positional=count, min_positional=minimum, keywords=keywords,
                sure_keywords=sure, mapping_keys=mapping_keys)


def problems(launch: Launch, options: frozenset[str]) -> list[str]:
    """What is wrong with one launch, by the module docstring's rules (a)-(d)."""
    kernel, found = launch.kernel, []
    params = set(kernel.params)
    head = f"{launch.where}: {kernel.name} ({kernel.path})"
    unknown = [k for k in launch.keywords if k not in params and k not in options]
    if unknown:
        found.append(f"{head}: keywords {unknown} are neither parameters nor launch options")
    repeated = sorted({k for k in launch.keywords if launch.keywords.count(k) > 1})
    filled = kernel.params[:launch.num_positional]
    twice = repeated + [k for k in launch.keywords if k in filled]
    if twice:
        found.append(f"{head}: {sorted(set(twice))} given twice")
    if launch.num_positional > len(kernel.params):
        found.append(f"{head}: {launch.num_positional} positional arguments for {len(kernel.params)} parameters")
    unset = kernel.params[launch.num_positional:]
    missing = [p for p in unset if p in kernel.required and p not in launch.sure_keywords]
    if missing:
        found.append(f"{head}: {launch.num_positional} positional arguments leave {missing} unset")
    for source, keys in launch.mapping_keys.items():
        lacking = sorted(k for k in keys if k not in options and k not in params)
        if lacking:
            found.append(f"{head}: **{source} fills {lacking}, which the kernel lacks")
    return found


def _our_sources() -> dict[str, str]:
    """The files under SCANNED that may define or launch a kernel: those naming triton or one of the `*kernel*`
    functions, or launching something called `*kernel*` (parsing all of them would take seconds)."""
    texts = {str(path.relative_to(ROOT)): path.read_text() for root in SCANNED for path in (ROOT / root).rglob("*.py")}
    names = {name for text in texts.values() if "triton" in text
             for name in re.findall(r"@(?:triton\.)?jit\b[^\n]*\n\s*def (\w*kernel\w*)", text)}
    wanted = re.compile(r"triton|kernel\w*\[.*\]\(|\b(?:" + "|".join(sorted(names)) + r")\b")
    return {path: text for path, text in sorted(texts.items()) if wanted.search(text)}


@pytest.fixture(scope="module")
def scanned() -> tuple[dict[str, Module], list[Launch], dict]:
    modules = parse(_our_sources())
    return (modules, *find_launches(modules))


def test_every_launch_matches_its_kernel(scanned):
    _, launches, _ = scanned
    options = launch_options()
    assert {"num_warps", "num_stages", "launch_pdl"} <= options
    found = [p for launch in launches for p in problems(launch, options)]
    assert not found, "\n".join(found)


def test_unexplained_launches_are_the_allow_list(scanned):
    _, _, unexplained = scanned
    assert set(unexplained) == set(UNEXPLAINED), (
        "launches not resolved: " + "; ".join(f"{k}: {v}" for k, v in unexplained.items() if k not in UNEXPLAINED)
        + " | allow-listed but resolved or gone: " + "; ".join(map(str, set(UNEXPLAINED) - set(unexplained))))


def test_the_scan_sees_our_launches(scanned):
    """A floor, so a scanner that stopped finding kernels or launches fails instead of passing vacuously."""
    modules, launches, _ = scanned
    kernels = {(k.path, k.name) for m in modules.values() for k in m.kernels.values()}
    launched = {(launch.kernel.path, launch.kernel.name) for launch in launches}
    assert len(kernels) >= 70 and len(launched) >= 40
    named_inside = {n.id if isinstance(n, ast.Name) else n.attr for m in modules.values() for f in m.kernel_defs
                    for statement in f.body for n in ast.walk(statement) if isinstance(n, (ast.Name, ast.Attribute))}
    unreached = sorted(f"{path}: {name}" for path, name in kernels - launched if name not in named_inside)
    assert not unreached, f"kernels neither launched (as far as this scan sees) nor used in a kernel: {unreached}"
    pdl_launches = [launch for launch in launches if any("pdl.options" in s for s in launch.mapping_keys)]
    assert len(pdl_launches) >= 10
    stars = [launch for launch in launches if launch.num_positional != launch.min_positional]
    assert len(stars) >= 5  # *strides, *outs, *extra, ... were counted, not skipped


_SEEDED = {
    "pkg/pdl.py": 'def options(x):\n    return {"PDL": True, "launch_pdl": True} if x else {"PDL": False}\n',
    "pkg/k.py": '''"""pool [slots, c, w]"""
import triton
from pkg import pdl

@triton.jit
def _a(x, y, n, s0, s1, s2, BLOCK: tl.constexpr, PDL: tl.constexpr, EXTRA: tl.constexpr = 1):
    pass

@triton.jit
def _b(x, n, BLOCK: tl.constexpr):
    pass

def _launch(kernel, x, *extra):
    kernel[(1,)](x, *extra, BLOCK=4, num_warps=4)

def run(x, pool, flag):
    LINE
    _launch(_b, x, 3)
''',
}


@pytest.mark.parametrize("line, expected", [
    ("_a[(1,)](x, x, 1, *pool.stride(), BLOCK=2, **pdl.options(x))", None),
    ("_a[(1,)](x, x, 1, *pool.stride(), BLOCKS=2, **pdl.options(x))", "['BLOCKS'] are neither"),
    ("_a[(1,)](x, x, 1, *pool.stride(), **pdl.options(x))", "leave ['BLOCK'] unset"),
    ("_a[(1,)](x, x, 1, *pool.stride(), s2=3, BLOCK=2, PDL=True)", "['s2'] given twice"),
    ("_b[(1,)](x, 1, BLOCK=2, **pdl.options(x))", "fills ['PDL'], which the kernel lacks"),
    ("k = _a if flag else _b\n    k[(1,)](x, 1, BLOCK=2)", "_a (pkg/k.py): 2 positional arguments leave"),
    ("_launch(_b, x)", "1 positional arguments leave ['n'] unset"),
    ("_b[(1,)](x, 1, 2, 3, BLOCK=2)", "4 positional arguments for 3 parameters"),
])
def test_seeded_mismatches_are_caught(line, expected):
    """The checker itself fails on each kind of mistake (and passes the correct launch)."""
    modules = parse({path: text.replace("LINE", line) for path, text in _SEEDED.items()})
    launches, unexplained = find_launches(modules)
    assert not unexplained
    found = [p for launch in launches for p in problems(launch, FALLBACK_OPTIONS)]
    if expected is None:
        assert not found
    else:
        assert any(expected in p for p in found), found
