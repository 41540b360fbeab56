// CPU checks of csrc/fastcall_plan.h (tests/ops/test_fastcall_plan.py builds this): a
// K-padded plan's kept weight copies are taken only for the same tensor at the same
// version and storage, and the TMA GEMM's arguments lie where its parameters are.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "fastcall_plan.h"

namespace {

using namespace fuseml_fastcall;  // (the vocabulary under test)

std::vector<std::string> run() {
  std::vector<std::string> failed;
  auto check = [&](bool ok, const char* what) {
    if (!ok) failed.emplace_back(what);
  };
  at::Tensor w = at::randn({4, 3});
  at::Tensor other = at::randn({4, 3});
  Pad pad;
  pad.kp = 8;
  pad.weights.emplace_back(w, at::zeros({4, 8}));
  check(padded_copy(pad, w) != nullptr, "the same tensor at the same version");
  check(padded_copy(pad, other) == nullptr, "another tensor of the same shape");
  check(padded_copy(pad, w.view({4, 3})) == nullptr, "a view of it (another tensor)");
  w.add_(1);
  check(padded_copy(pad, w) == nullptr, "after an in-place write (a new version)");
  Pad again;
  again.kp = 8;
  again.weights.emplace_back(w, at::zeros({4, 8}));
  check(padded_copy(again, w) != nullptr, "kept again at the new version");
  w.set_data(at::randn({4, 3}));  // w.data = other: the version stays, the storage not
  check(padded_copy(again, w) == nullptr, "after its storage was swapped");
  Pad freed;
  freed.kp = 8;
  {
    at::Tensor gone = at::randn({4, 3});
    freed.weights.emplace_back(gone, at::zeros({4, 8}));
  }
  check(freed.weights[0].of.expired(), "a freed tensor's reference expires");
  check(padded_copy(freed, at::randn({4, 3})) == nullptr, "a tensor made after a freed one");

  Descs descs;
  descs.n = 3;
  descs.of[0] = kOfX;
  descs.of[1] = kOfW;
  descs.of[2] = kOfOut;
  Value v[64];
  const at::Tensor out = at::empty({5, 7});
  const int n = fill_tma(5, 7, 16, std::nullopt, out, 2.0, descs, v);
  const int64_t out_ptr = reinterpret_cast<int64_t>(out.data_ptr());
  check(n == 36, "the TMA GEMM's arguments: 36 positions");
  check(v[0].i == 0 && v[1].i == 5 && v[2].i == 16 && v[3].i == 16 && v[4].i == 1,
        "descriptor 0: x (5, 16)");
  check(v[5].i == 1 && v[6].i == 7 && v[7].i == 16 && v[8].i == 16 && v[9].i == 1,
        "descriptor 1: W (7, 16)");
  check(v[10].i == out_ptr && v[11].i == out_ptr && v[12].i == out_ptr,
        "no bias or residual: out in their places");
  check(v[13].i == 5 && v[14].i == 7 && v[15].i == 16 && v[16].i == 0 && v[17].i == 7,
        "m, n, k, the residual's and out's row strides");
  check(v[18].f == 2.0, "alpha");
  check(v[19 + kTmaConstexprs].i == 2 && v[32].i == 5 && v[33].i == 7 && v[34].i == 7 &&
            v[35].i == 1,
        "descriptor 2: out (5, 7) after the constexprs");
  descs.of[2] = kOfX;
  fill_tma(5, 7, 16, std::nullopt, out, 2.0, descs, v);
  check(v[32].i == 5 && v[33].i == 16, "descriptor 2: x's where out is stored by pointer");
  return failed;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run, "the failed checks"); }
