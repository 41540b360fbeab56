// csrc/fastcall_state.h on the CPU (tests/ops/test_fastcall_plan.py builds this): the
// module replay key the eager fast path reads in C++, exposed as fuseml.serving calls it.
#include <torch/extension.h>

#include "fastcall_state.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("state_key", &fuseml_fastcall::state_key, "a module's replay key");
}
