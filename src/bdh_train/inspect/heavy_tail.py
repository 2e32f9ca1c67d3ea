"""The heavy-tail fit of a degree distribution: Clauset, Shalizi and Newman's (2009) discrete
power law p(k) ~ k^-alpha for k >= xmin, alpha by maximum likelihood and xmin the value that
minimises the Kolmogorov-Smirnov distance between the data above it and the fit, judged
against an exponential tail by their log-likelihood ratio test (R > 0 favours the power law;
p is the chance of a |R| this large when neither fits better). Computed by the `powerlaw`
package (Alstott et al.), which implements exactly that method.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from bdh_train.errors import BDHTrainError


def heavy_tail_fit(values: Any) -> dict[str, float]:
    """{alpha, xmin, ks_distance, tail_count, loglik_ratio_vs_exponential, p_value} of the
    discrete power-law fit of `values` (positive integers, at least three distinct)."""
    try:
        import powerlaw
    except ImportError:
        raise BDHTrainError(
            "the heavy-tail fit needs the 'powerlaw' package: pip install 'bdh-train[inspect]'"
        ) from None
    data = np.asarray(values, dtype=np.float64)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the package warns about its own numerics
        fit = powerlaw.Fit(data, discrete=True, verbose=False)
        ratio, p = fit.distribution_compare("power_law", "exponential", normalized_ratio=True)
    law = fit.power_law
    return {
        "alpha": float(law.alpha),
        "xmin": float(law.xmin),
        "ks_distance": float(law.D),
        "tail_count": int(np.sum(data >= law.xmin)),
        "loglik_ratio_vs_exponential": float(ratio),
        "p_value": float(p),
    }
