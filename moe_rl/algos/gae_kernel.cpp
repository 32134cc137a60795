// Masked model-token GAE, one fused pass per sample (CPU).
// Same recursion as moe_rl/algos/gae.py: walk each row right to left; valid (mask 1) positions
// advance A_j = delta_j + g * A_{j+1}; mask-0 positions leave the trace and next value untouched and
// get 0. Reads rewards, values and mask once and writes advantages and returns once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

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
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        const int64_t base = b * T;
        scalar_t next_v = bp[b], last = 0;
        const scalar_t gl = gp[b];
        for (int64_t t = T - 1; t >= 0; --t) {
          // Branch-free: observation spans and padding cost no mispredictions.
          const int64_t i = base + t;
          const bool valid = mk[i];
          const scalar_t vi = v[i];
          const scalar_t cand = r[i] + gam * next_v - vi + gl * last;
          last = valid ? cand : last;
          next_v = valid ? vi : next_v;
          a[i] = valid ? last : scalar_t(0);
          o[i] = valid ? last + vi : scalar_t(0);
        }
      }
    });
  });
  return {adv, ret};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { mod.def("masked_gae_cpu", &masked_gae_cpu); }
