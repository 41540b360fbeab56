// One replay of a captured forward from C++ (fuseml.serving.ReplayCache): the call's
// inputs copied into the graph's static inputs, the graph launched, its output copied out,
// all on the current stream. torch.cuda.CUDAGraph.replay() also advances the random number
// generators the graph drew from; the cache sends here only graphs whose first replay left
// the default generator's offset where it was (nothing random in them).
// Included by fastcall.cpp alone (one translation unit).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace fuseml_fastcall {

// exec: the graph's cudaGraphExec_t (CUDAGraph.raw_cuda_graph_exec()); statics: the
// tensors the graph reads its inputs from; out: the tensor it writes. Returns a copy of
// out (each call's own tensor).
inline at::Tensor replay(uint64_t exec, const std::vector<at::Tensor>& statics,
                         const std::vector<at::Tensor>& inputs, const at::Tensor& out) {
  TORCH_CHECK(statics.size() == inputs.size(), "replay: ", inputs.size(),
              " inputs for a graph of ", statics.size());
  TORCH_CHECK(out.is_cuda(), "replay: the graph's output is not a CUDA tensor");
  c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(out.device().index()).stream();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& s = statics[i];
    const at::Tensor& x = inputs[i];
    TORCH_CHECK(s.sizes() == x.sizes(), "replay: input ", i, " has shape ", x.sizes(),
                ", the graph's ", s.sizes());
    bool flat = s.is_contiguous() && x.is_contiguous() && x.is_cuda() &&
                s.scalar_type() == x.scalar_type() && s.device() == x.device();
    if (flat) {  // (one memcpy node, no dispatch)
      C10_CUDA_CHECK(cudaMemcpyAsync(s.data_ptr(), x.data_ptr(), x.nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
    } else {
      s.copy_(x);
    }
  }
  C10_CUDA_CHECK(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(exec), stream));
  at::Tensor copy = at::empty_like(out, at::MemoryFormat::Preserve);
  if (out.is_contiguous() && copy.is_contiguous()) {
    C10_CUDA_CHECK(cudaMemcpyAsync(copy.data_ptr(), out.data_ptr(), out.nbytes(),
                                   cudaMemcpyDeviceToDevice, stream));
  } else {
    copy.copy_(out);
  }
  return copy;
}

}  // namespace fuseml_fastcall
