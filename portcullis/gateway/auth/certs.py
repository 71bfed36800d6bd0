"""mTLS authentication: a verified client certificate's name resolves to a principal of the policy.

The TLS layer (gateway.tls, gateway.connection) verified the certificate against
--ssl-ca-certs and took its names (DNS, URI and email subject alternative names; the subject's
common name only when there is no SAN); here the policy's `client_certs` maps them to an entry
of `principals:`, which gives the tenant, scopes, models and limits, as for keys and JWT subjects.
"""

from __future__ import annotations

from portcullis.gateway.auth.principal import Principal
from portcullis.gateway.errors import Refusal
from portcullis.gateway.policy.loader import LoadedPolicy


def authenticate_client_cert(names: tuple[str, ...], loaded: LoadedPolicy) -> Principal:
    mapping = loaded.policy.client_certs
    matched = {name: mapping[name] for name in names if name in mapping}
    principals = sorted(set(matched.values()))
    if len(principals) > 1:  # never let the order of a certificate's names pick who it is
        shown = ", ".join(f"{name} -> {principal}" for name, principal in matched.items())
        raise Refusal(401, f"The client certificate's names map to more than one principal ({shown}); "
                      "ask an admin to map its names in the policy's client_certs to one principal only.",
                      "ambiguous_client_certificate")
    if principals:
        rule = loaded.policy.principals[principals[0]]  # the policy checks that it is listed
        return Principal(principals[0], rule.tenant, frozenset(rule.scopes), None, "mtls")
    shown = ", ".join(names[:4])
    raise Refusal(401, f"The client certificate ({shown}) is not mapped to a principal; send an API key, "
                  "or ask an admin to add one of its names to the policy's client_certs.",
                  "unknown_client_certificate")
