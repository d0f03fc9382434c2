// `wavecore::rms_norm`, the kernel of `rms_norm.c` as a torch operator
// (`model/native_norm.py`), registered through torch's stable C ABI, so that eager code
// calls it without Python. The schema and the shape function are `native_norm.py`'s.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>

extern "C" void wavecore_rms_norm(const float *x, const float *w, int64_t rows, int64_t n,
                                  float eps, float *out);

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

Tensor rms_norm(Tensor x, Tensor weight, double eps) {
    STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_cpu(),
                    "rms_norm: x must be a 2-D float32 CPU tensor");
    STD_TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                        weight.scalar_type() == ScalarType::Float && weight.is_contiguous(),
                    "rms_norm: weight must be a contiguous float32 vector of x's width");
    Tensor rows = torch::stable::contiguous(x);
    Tensor out = torch::stable::empty_like(rows);
    wavecore_rms_norm(static_cast<const float *>(rows.data_ptr()),
                      static_cast<const float *>(weight.data_ptr()), rows.size(0),
                      rows.size(1), static_cast<float>(eps), static_cast<float *>(out.data_ptr()));
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(wavecore, CPU, m) {
    m.impl("rms_norm", TORCH_BOX(&rms_norm));
}
