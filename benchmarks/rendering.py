"""Offscreen rendering for the MuJoCo simulators (MetaWorld, LIBERO, ALOHA, OGBench): one place for its traps.

**The OpenGL backend.** MuJoCo picks it once, when ``mujoco`` is first imported, from
``MUJOCO_GL`` (and PyOpenGL binds its platform at the same moment), so it cannot be
switched when a context later fails to come up. Importing this module, which every
simulator module does before it imports its simulator, chooses for a headless host:
when ``MUJOCO_GL`` is unset and there is no ``DISPLAY``, ``egl`` if ``libEGL`` can be
found (Mesa's EGL falls back to the llvmpipe software rasteriser on a host without a
GPU), else ``osmesa`` if ``libOSMesa`` can be found, else ``egl`` (whose failure then
names the fix). A user's ``MUJOCO_GL`` is never overridden; a worker image sets it in its
environment rather than rely on import order.

**Two LLVMs.** Mesa's llvmpipe loads its libLLVM with ``RTLD_GLOBAL``; triton's
libtriton.so (torch imports triton on ``import torch._dynamo``) carries its own LLVM, binds
to Mesa's symbols and crashes the process (SIGSEGV) when it is imported after Mesa —
measured with triton 3.9 and Mesa's LLVM 15. ``import_triton_before_mesa()`` (~0.1 s, once
per process) must run before anything loads Mesa: the first renderer, and simulators such
as dm_control that load it at import.

**No context.** ``RenderingUnavailable`` is what rendering raises when no OpenGL context
can be made; ``no_context_advice(exc)`` says which backend MuJoCo really bound and what to
install or set. ``offscreen_renderer(model, height, width, where)`` makes a
``mujoco.Renderer`` with all of the above (MetaWorld and OGBench use it; LIBERO and ALOHA
render through robosuite's and dm_control's own renderers).
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import sys
from typing import Any


class RenderingUnavailable(RuntimeError):
    """No offscreen OpenGL context can be made in this process."""


def headless_gl_backend() -> str:
    """``egl`` where libEGL is installed, else ``osmesa`` where libOSMesa is, else ``egl``."""
    if ctypes.util.find_library("EGL"):
        return "egl"
    if ctypes.util.find_library("OSMesa"):
        return "osmesa"
    return "egl"


# Headless hosts: MuJoCo picks its OpenGL backend once, when it is first imported.
if "MUJOCO_GL" not in os.environ and not os.environ.get("DISPLAY"):
    os.environ["MUJOCO_GL"] = headless_gl_backend()


def import_triton_before_mesa() -> None:
    """Import triton (when installed) before the first OpenGL context loads Mesa (see the module docstring)."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    try:
        import triton  # noqa: F401
    except Exception:  # a triton that cannot import here cannot be imported later either: nothing to protect
        pass


def no_context_advice(exc: Exception) -> str:
    """Why MuJoCo made no OpenGL context (``exc``), with the backend it really uses and the fix."""
    import mujoco

    # The backend MuJoCo bound at its import (its GLContext class lives in mujoco.egl, mujoco.osmesa,
    # mujoco.glfw, ...), which is not MUJOCO_GL's value when MuJoCo was imported before it was set.
    backend = mujoco.gl_context.GLContext.__module__.rsplit(".", 1)[-1]
    requested = os.environ.get("MUJOCO_GL", "")
    late = (f"MuJoCo was imported before MUJOCO_GL={requested} took effect, so it uses {backend}; "
            if requested and requested.lower() != backend else "")
    return (f"MuJoCo cannot make an offscreen OpenGL context with its {backend} backend "
            f"({type(exc).__name__}: {exc}); {late}install Mesa's EGL (libegl1) or OSMesa (libosmesa6) and start "
            "the process with MUJOCO_GL=egl or MUJOCO_GL=osmesa in its environment (MuJoCo reads it once, at import)")


def offscreen_renderer(model: Any, height: int, width: int, where: str) -> Any:
    """A ``mujoco.Renderer`` for ``model`` at ``height`` × ``width``, its offscreen buffer grown to hold the
    frame (it is allocated once, with the context); ``RenderingUnavailable`` naming ``where`` and the fix
    when no context can be made."""
    import_triton_before_mesa()
    import mujoco

    model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
    model.vis.global_.offheight = max(model.vis.global_.offheight, height)
    try:
        return mujoco.Renderer(model, height=height, width=width)
    except Exception as exc:  # what each backend raises without a display or a GL library varies
        raise RenderingUnavailable(f"{where}: {no_context_advice(exc)}") from exc
