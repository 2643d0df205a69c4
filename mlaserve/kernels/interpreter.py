"""The Triton interpreter (TRITON_INTERPRET=1: the CPU runs the kernels, in tests and debugging) without its cost per
device-function call.

Every call of a `@triton.jit` helper from inside a kernel (`_mac`, `_finish_row`, `quant_group_rows`, ...) makes the
interpreter patch triton.language again: `inspect.getmembers` over tl, tl.tensor and tl.math, replacing nothing,
since the launch has already patched those modules (and a device call's own patching, of tl.core for triton's
helpers such as tl.cdiv, is never undone). That was half of an interpreted MoE layer's time. `install()` makes a
device call skip it when the modules its globals name have been patched in this launch; the launch itself patches
and restores as before.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# once installed: (the interpreter module, its _patch_lang, GridExecutor.__call__)
_originals: tuple | None = None


class _NoRestore:
    def restore(self) -> None:
        pass


def install() -> bool:
    """Under TRITON_INTERPRET=1, once per process; True when the interpreter's device calls now skip repatching.
    Leaves the interpreter as it is (and returns False) when its internals are not the ones this was written for."""
    global _originals
    if _originals is not None or os.environ.get("TRITON_INTERPRET") != "1":
        return _originals is not None
    try:
        from triton.runtime import interpreter as ti
        patch_lang, launch = ti._patch_lang, ti.GridExecutor.__call__
        langs_of = (ti.tl, ti.tl.core)
    except (ImportError, AttributeError) as e:
        logger.debug("Triton interpreter: device calls keep repatching (%s)", e)
        return False
    patched: list[set[int]] = []        # inside a launch: the ids of the language modules patched so far
    langs_by_fn: dict = {}              # fn -> the language modules its globals name (as _patch_lang finds them)

    def repatch_once(fn):
        langs = langs_by_fn.get(fn)
        if langs is None:
            langs = langs_by_fn[fn] = {id(v) for v in fn.__globals__.values() if any(v is m for m in langs_of)}
        if patched and langs and langs <= patched[-1]:
            return _NoRestore()             # a device call: what it would patch is patched
        scope = patch_lang(fn)
        if patched:
            patched[-1] |= langs
        return scope

    def run_launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    _originals = (ti, patch_lang, launch)
    ti._patch_lang = repatch_once
    ti.GridExecutor.__call__ = run_launch
    return True


def uninstall() -> None:
    """The interpreter as Triton ships it again (tests compare the two)."""
    global _originals
    if _originals is not None:
        ti, patch_lang, launch = _originals
        ti._patch_lang, ti.GridExecutor.__call__ = patch_lang, launch
        _originals = None
