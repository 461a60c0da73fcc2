"""kvsteward.pipelines."""
