"""One APIRouter per concern: liveness/readiness probes, and the policy-checked proxy."""
