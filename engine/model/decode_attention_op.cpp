// `wavecore::decode_attention`, the kernel of `decode_attention.c` as a torch operator
// (`model/native_attention.py`), registered through torch's stable C ABI: the dispatcher
// calls it without Python, from eager code and from a compiled graph alike.
// The schema and the shape function are `native_attention.py`'s; this adds the CPU kernel.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstdint>

extern "C" int wavecore_decode_attention(const float *queries, const uint16_t *key_pool,
                                         const uint16_t *value_pool, const int64_t *tables,
                                         int64_t table_stride, const int64_t *lengths,
                                         int64_t seqs, int64_t heads, int64_t kv_heads,
                                         int64_t dim, int64_t block_size, float scale,
                                         float *out);

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

namespace {

// Shapes and dtypes are checked here; the tables' block ids and the lengths are not
// (`batch_plan.check_chunk` checked them against the cache: rule 5 of the Python side).
Tensor decode_attention(Tensor queries, Tensor key_pool, Tensor value_pool,
                        Tensor block_tables, Tensor context_lens, double scale) {
    STD_TORCH_CHECK(queries.dim() == 3 && queries.scalar_type() == ScalarType::Float &&
                        queries.is_cpu(),
                    "decode_attention: queries must be [seqs, heads, head_dim] float32 on the CPU");
    STD_TORCH_CHECK(key_pool.dim() == 4 && key_pool.scalar_type() == ScalarType::BFloat16 &&
                        key_pool.is_cpu() && key_pool.is_contiguous() &&
                        value_pool.scalar_type() == ScalarType::BFloat16 &&
                        value_pool.is_contiguous() && value_pool.dim() == 4 &&
                        value_pool.numel() == key_pool.numel(),
                    "decode_attention: the pools must be contiguous bfloat16 "
                    "[blocks, block_size, kv_heads, head_dim] of one shape");
    int64_t seqs = queries.size(0), heads = queries.size(1), dim = queries.size(2);
    STD_TORCH_CHECK(key_pool.size(3) == dim, "decode_attention: head sizes differ");
    STD_TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seqs &&
                        block_tables.scalar_type() == ScalarType::Long &&
                        context_lens.dim() == 1 && context_lens.size(0) == seqs &&
                        context_lens.scalar_type() == ScalarType::Long,
                    "decode_attention: block_tables must be [seqs, blocks] and context_lens "
                    "[seqs], int64");
    Tensor q = torch::stable::contiguous(queries);
    Tensor tables = torch::stable::contiguous(block_tables);
    Tensor lengths = torch::stable::contiguous(context_lens);
    Tensor out = torch::stable::empty_like(q);
    int status = wavecore_decode_attention(
        static_cast<const float *>(q.data_ptr()),
        static_cast<const uint16_t *>(key_pool.data_ptr()),
        static_cast<const uint16_t *>(value_pool.data_ptr()),
        static_cast<const int64_t *>(tables.data_ptr()), tables.size(1),
        static_cast<const int64_t *>(lengths.data_ptr()), seqs, heads, key_pool.size(2), dim,
        key_pool.size(1), static_cast<float>(scale), static_cast<float *>(out.data_ptr()));
    STD_TORCH_CHECK(status == 0, "decode_attention: the kernel failed (",
                    status == 2 ? "out of memory" : "shapes it cannot take", ")");
    return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(wavecore, CPU, m) {
    m.impl("decode_attention", TORCH_BOX(&decode_attention));
}
