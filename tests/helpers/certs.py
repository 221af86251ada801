"""Test certificates for mTLS: a CA and leaf certificates for 127.0.0.1, localhost and this
test process's private loopback address."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.helpers import ports


@dataclasses.dataclass(frozen=True)
class Identity:
    """PEM file paths of one identity."""

    cert_file: str
    key_file: str
    ca_file: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(cert, key, ca) bytes."""
        out = []
        for path in (self.cert_file, self.key_file, self.ca_file):
            with open(path, "rb") as fh:
                out.append(fh.read())
        return out[0], out[1], out[2]

    def env(self, section: str) -> dict[str, str]:
        """REPLICAPLANE_<SECTION>_TLS_* variables naming these files."""
        upper = section.upper()
        return {
            f"REPLICAPLANE_{upper}_TLS_CERT_FILE": self.cert_file,
            f"REPLICAPLANE_{upper}_TLS_KEY_FILE": self.key_file,
            f"REPLICAPLANE_{upper}_TLS_CA_FILE": self.ca_file,
        }


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class Authority:
    """A CA that writes its certificate and leaf identities into `folder`."""

    def __init__(self, folder: str, name: str = "test-ca") -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_file = os.path.join(folder, f"{name}.pem")
        with open(self.ca_file, "wb") as fh:
            fh.write(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str) -> Identity:
        """A leaf certificate named `cn`, valid for 127.0.0.1, localhost and ports.private_host(),
        client and server."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName(cn),
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        # Where clusters run the services they restart (ports.private_host).
                        x509.IPAddress(ipaddress.ip_address(ports.private_host())),
                    ]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        cert_file = os.path.join(self.folder, f"{cn}.pem")
        key_file = os.path.join(self.folder, f"{cn}.key")
        with open(cert_file, "wb") as fh:
            fh.write(cert.public_bytes(serialization.Encoding.PEM))
        with open(key_file, "wb") as fh:
            fh.write(_key_pem(key))
        os.chmod(key_file, 0o600)
        return Identity(cert_file, key_file, self.ca_file)
