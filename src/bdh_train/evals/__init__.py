"""Evaluations of a trained model: per-token scoring of many sequences (`scoring`, what the
lm-evaluation-harness backend `bdh_train.evals.lm_eval` and the measures below share), and the
measures of what the carried state remembers (`memory`: the context curve and retention;
`passkey`: a needle in a haystack). `bdh-train eval --context-curve / --retention /
--passkey` runs them."""
