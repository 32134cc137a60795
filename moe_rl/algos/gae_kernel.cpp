// Masked model-token GAE, one fused pass over the data (CPU).
// Same recursion as moe_rl/algos/gae.py: walk each row right to left; valid (mask 1) positions
// advance A_j = delta_j + g * A_{j+1}; mask-0 positions leave the trace and the next value untouched
// and get 0. Reads rewards, values and mask once and writes advantages and returns once.
//
// The recursion is a serial dependency chain per row, so ROWS rows are walked together: their chains
// are independent and the core overlaps them (latency-bound -> throughput-bound).
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {
constexpr int64_t ROWS = 4;

template <typename scalar_t, int64_t N>
void scan_rows(const scalar_t* r, const scalar_t* v, const bool* mk, const scalar_t* boot, const scalar_t* g,
               scalar_t gam, int64_t T, scalar_t* a, scalar_t* o) {
  scalar_t next_v[N], last[N];
  for (int64_t k = 0; k < N; ++k) { next_v[k] = boot[k]; last[k] = 0; }
  for (int64_t t = T - 1; t >= 0; --t) {
    for (int64_t k = 0; k < N; ++k) {  // unrolled by the compiler: N independent chains
      const int64_t i = k * T + t;
      const bool valid = mk[i];
      const scalar_t vi = v[i];
      const scalar_t cand = r[i] + gam * next_v[k] - vi + g[k] * last[k];
      last[k] = valid ? cand : last[k];
      next_v[k] = valid ? vi : next_v[k];
      a[i] = valid ? last[k] : scalar_t(0);
      o[i] = valid ? last[k] + vi : scalar_t(0);
    }
  }
}
}  // namespace

std::vector<torch::Tensor> masked_gae_cpu(torch::Tensor rewards, torch::Tensor values, torch::Tensor mask,
                                          torch::Tensor boot, torch::Tensor g, double gamma) {
  TORCH_CHECK(values.dim() == 2 && rewards.sizes() == values.sizes() && mask.sizes() == values.sizes(),
              "masked_gae_cpu: rewards, values, mask must be [B, T] of one shape");
  rewards = rewards.contiguous();
  values = values.contiguous();
  auto m = mask.to(torch::kBool).contiguous();
  const int64_t B = values.size(0), T = values.size(1);
  auto adv = torch::empty_like(values);
  auto ret = torch::empty_like(values);
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "masked_gae_cpu", [&] {
    auto bt = boot.to(values.scalar_type()).contiguous();
    auto gt = g.to(values.scalar_type()).contiguous();
    const scalar_t* r = rewards.data_ptr<scalar_t>();
    const scalar_t* v = values.data_ptr<scalar_t>();
    const bool* mk = m.data_ptr<bool>();
    const scalar_t* bp = bt.data_ptr<scalar_t>();
    const scalar_t* gp = gt.data_ptr<scalar_t>();
    scalar_t* a = adv.data_ptr<scalar_t>();
    scalar_t* o = ret.data_ptr<scalar_t>();
    const scalar_t gam = static_cast<scalar_t>(gamma);
    const int64_t blocks = (B + ROWS - 1) / ROWS;
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = lo; blk < hi; ++blk) {
        const int64_t b = blk * ROWS, off = b * T;
        if (b + ROWS <= B) {
          scan_rows<scalar_t, ROWS>(r + off, v + off, mk + off, bp + b, gp + b, gam, T, a + off, o + off);
        } else {
          for (int64_t row = b; row < B; ++row) {
            const int64_t ro = row * T;
            scan_rows<scalar_t, 1>(r + ro, v + ro, mk + ro, bp + row, gp + row, gam, T, a + ro, o + ro);
          }
        }
      }
    });
  });
  return {adv, ret};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { mod.def("masked_gae_cpu", &masked_gae_cpu); }
