"""mTLS authentication: a verified client certificate's name resolves to a principal of the policy.

The TLS layer (gateway.tls, gateway.connection) verified the certificate against
--ssl-ca-certs; here the policy's `client_certs` maps one of its names (a DNS, URI or email
subject alternative name, or the subject's common name) to an entry of `principals:`, which
gives the tenant, scopes, models and limits, as it does for keys and JWT subjects.
"""

from __future__ import annotations

from gateway.auth.principal import Principal
from gateway.errors import Refusal
from gateway.policy.loader import LoadedPolicy


def authenticate_client_cert(names: tuple[str, ...], loaded: LoadedPolicy) -> Principal:
    mapping = loaded.policy.client_certs
    for name in names:
        principal = mapping.get(name)
        if principal is not None:
            rule = loaded.policy.principals[principal]  # the policy checks that it is listed
            return Principal(principal, rule.tenant, frozenset(rule.scopes), None, "mtls")
    shown = ", ".join(names[:4])
    raise Refusal(401, f"The client certificate ({shown}) is not mapped to a principal; send an API key, "
                  "or ask an admin to add one of its names to the policy's client_certs.",
                  "unknown_client_certificate")
