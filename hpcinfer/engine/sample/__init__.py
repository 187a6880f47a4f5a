"""From a step's logits to its tokens: penalties, batched sampling with per-row seeds,
log-probabilities, stop rules, and the fork of `n` samples from one prefill."""
