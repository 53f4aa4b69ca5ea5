"""TLS between the control plane and a worker's front door, pinned to the worker's certificate.

A worker makes a self-signed certificate when it starts (``self_signed_certificate``) and
registers it with the control plane over the worker API, which the worker reaches with its
token. The control plane then trusts exactly that certificate for that worker
(``pinned_context``): no certificate authority is involved and no host name is checked, since
the pin, not a name, says which machine is the worker. A machine that answers at the worker's
address with any other certificate is refused before the engine secret is sent.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import ssl

import httpx

# Long enough that no worker outlives it; a new worker makes a new one.
CERTIFICATE_DAYS = 3650
PROBE_TIMEOUT = httpx.Timeout(5.0)


def self_signed_certificate(hosts: list[str]) -> tuple[str, str]:
    """A fresh EC P-256 key and a self-signed server certificate for ``hosts`` (PEM, PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "skytrain worker")])
    alternative_names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            alternative_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alternative_names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    public_key = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(public_key), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    certificate_pem = certificate.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return certificate_pem, key_pem


def fingerprint(certificate_pem: str) -> str:
    """The certificate's SHA-256 fingerprint, as ``openssl x509 -fingerprint`` prints it."""
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(certificate_pem)).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def check_certificate(certificate_pem: str) -> None:
    """Raise ValueError unless ``certificate_pem`` is one PEM certificate that TLS can pin."""
    try:
        pinned_context(certificate_pem)
    except (ssl.SSLError, ValueError) as exc:
        raise ValueError(f"not a PEM certificate ({exc})") from None


def pinned_context(certificate_pem: str) -> ssl.SSLContext:
    """A client context that accepts exactly this certificate, whatever the host's name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=certificate_pem)
    return context


def server_context(certificate_path: str, key_path: str) -> ssl.SSLContext:
    """The front door's side: TLS 1.2 or newer with the worker's certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certificate_path, key_path)
    return context


def probe(url: str, *, certificate_pem: str, secret: str) -> str | None:
    """Reach a worker's front door as the gateway will; None when it answers, else why not."""
    try:
        with httpx.Client(verify=pinned_context(certificate_pem), timeout=PROBE_TIMEOUT) as client:
            response = client.get(
                url.rstrip("/") + "/health", headers={"Authorization": f"Bearer {secret}"}
            )
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if response.status_code != 200:
        return f"it answered /health with HTTP {response.status_code}"
    return None
