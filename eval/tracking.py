"""MLflow tracking defaults for eval: the same store as training (one implementation, in `kvsteward.train.tracking`)."""

from kvsteward.train.tracking import default_tracking_uri, ensure_tracking

__all__ = ["default_tracking_uri", "ensure_tracking"]
