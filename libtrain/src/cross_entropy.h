// The loss half of softmax cross-entropy, shared by the backends (backend.h defines it: PyTorch's
// CrossEntropyLoss with class weights, label smoothing and reduction='mean').
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/formulas.h"

namespace slide::train::detail {

// logp[N, C]: log-probabilities in, probabilities out (exp in place). labels[N] in [0, C);
// weights[C] or null (all 1). Returns sum_n (-sum_c t_nc logp_nc) / sum_n w[y_n], t the weighted
// smoothed target (formulas.h cross_entropy_target: PyTorch's loss with weight and
// label_smoothing); 0 when the weights sum to 0.
template <typename T>
double nll_to_probs(T* logp, const int32_t* labels, const T* weights, int64_t n_rows, int64_t classes,
                    double smoothing) {
  double total = 0, weight_sum = 0;
  for (int64_t n = 0; n < n_rows; ++n) {
    const double wn = weights != nullptr ? double(weights[labels[n]]) : 1.0;
    double nll = 0;
    for (int64_t c = 0; c < classes; ++c) {
      T& v = logp[n * classes + c];
      const double wc = weights != nullptr ? double(weights[c]) : 1.0;
      const double target = formulas::cross_entropy_target(c, labels[n], smoothing, classes, wn, wc);
      nll -= target * double(v);
      v = static_cast<T>(std::exp(double(v)));
    }
    total += nll;
    weight_sum += wn;
  }
  return weight_sum > 0 ? total / weight_sum : 0.0;
}

}  // namespace slide::train::detail
