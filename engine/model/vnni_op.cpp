// `wavecore::vnni_product`, the kernel of `vnni_product.c` as a torch operator
// (`model/vnni_linear.py`), registered through torch's stable C ABI: the dispatcher calls
// it without Python, from eager code and from a compiled graph's C++ wrapper alike
// (a Python custom op cost about 4 us more a call, and a step makes 121).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>
#include <vector>

extern "C" int wavecore_vnni_product(const float *x, int64_t m, int64_t k, int64_t n, int bits,
                                     const uint8_t *weights, float *out);
extern "C" int64_t wavecore_vnni_packed_bytes(int bits, int64_t k, int64_t n);

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

Tensor vnni_product(Tensor x, Tensor packed, int64_t bits, int64_t out_features) {
    STD_TORCH_CHECK(x.dim() == 2 && x.scalar_type() == ScalarType::Float && x.is_cpu(),
                    "vnni_product: x must be a 2-D float32 CPU tensor");
    int64_t rows = x.size(0), in_features = x.size(1);
    int64_t expected = wavecore_vnni_packed_bytes(static_cast<int>(bits), in_features, out_features);
    STD_TORCH_CHECK(packed.scalar_type() == ScalarType::Byte && packed.is_cpu() &&
                        packed.is_contiguous() && packed.numel() == expected && expected > 0,
                    "vnni_product: ", packed.numel(), " packed bytes do not hold ", bits,
                    "-bit weights of ", in_features, " inputs and ", out_features, " outputs");
    Tensor contiguous = torch::stable::contiguous(x);
    Tensor out = torch::stable::new_empty(contiguous, std::vector<int64_t>{rows, out_features});
    if (rows == 0) return out;
    int status = wavecore_vnni_product(
        static_cast<const float *>(contiguous.data_ptr()), rows, in_features, out_features,
        static_cast<int>(bits), static_cast<const uint8_t *>(packed.data_ptr()),
        static_cast<float *>(out.data_ptr()));
    STD_TORCH_CHECK(status == 0, "vnni_product: the kernel failed (",
                    status == 2 ? "out of memory" : "shapes it cannot take", ")");
    return out;
}

}  // namespace

// The schema and the shape function are `vnni_linear.py`'s (defined once per process at
// its import); loading this library adds the CPU kernel.
STABLE_TORCH_LIBRARY_IMPL(wavecore, CPU, m) {
    m.impl("vnni_product", TORCH_BOX(&vnni_product));
}
