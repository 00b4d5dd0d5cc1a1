"""Test settings: hypothesis runs derandomized (reproducible in CI) with no example database."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "vfsdp",
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("vfsdp")
