"""llama-cpp-python's server with use_extra_bufts = False (no AMX repacking): on an Intel
host with AMX, llama.cpp 0.3.36's server otherwise dies at `ldtilecfg` (docs/benchmarks.md)."""
import runpy

import llama_cpp.llama_cpp as lib

_default = lib.llama_model_default_params


def _params():
    params = _default()
    params.use_extra_bufts = False
    return params


lib.llama_model_default_params = _params  # llama_cpp.Llama reads it at construction
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
