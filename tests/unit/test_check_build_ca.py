""".ci/check_build_ca.py finds a build's private CA certificate anywhere in a saved image."""

from __future__ import annotations

import base64
import datetime
import io
import os
import subprocess
import sys
import tarfile
import textwrap

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, ".ci", "check_build_ca.py")


def make_ca(name: str) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def saved_image(files: dict[str, bytes]) -> bytes:
    """A tar holding a layer tar, as `docker save` writes one."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    outer = io.BytesIO()
    with tarfile.open(fileobj=outer, mode="w") as tar:
        info = tarfile.TarInfo("0123abcd/layer.tar")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    return outer.getvalue()


@pytest.fixture(scope="module")
def certs() -> dict[str, x509.Certificate]:
    return {"public": make_ca("Public Root"), "proxy": make_ca("Egress Proxy CA")}


@pytest.fixture
def bundle(tmp_path, certs) -> dict[str, str]:
    public_dir = tmp_path / "public"
    public_dir.mkdir()
    (public_dir / "root.crt").write_bytes(pem(certs["public"]))
    path = tmp_path / "bundle.crt"
    path.write_bytes(pem(certs["public"]) + pem(certs["proxy"]))
    return {"bundle": str(path), "public": str(public_dir)}


def check(bundle: dict[str, str], image: bytes) -> subprocess.CompletedProcess[str]:
    """Run the script with `image` as the saved image on its stdin."""
    result = subprocess.run(
        [sys.executable, SCRIPT, "--bundle", bundle["bundle"], "--public", bundle["public"], "--image", "img"],
        input=image,
        capture_output=True,
        timeout=60,
        check=False,
    )
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())


def test_an_image_with_only_public_roots_passes(bundle, certs) -> None:
    image = saved_image({"etc/ssl/certs/ca-certificates.crt": pem(certs["public"]), "app/x.py": b"print(1)\n"})
    result = check(bundle, image)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "holds none of the 1 private CA certificates" in result.stdout


def rewrapped(cert: x509.Certificate, width: int) -> bytes:
    body = base64.b64encode(der(cert)).decode()
    return ("-----BEGIN CERTIFICATE-----\r\n" + "\r\n".join(textwrap.wrap(body, width)) + "\r\n").encode()


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(lambda c: pem(c), id="pem"),
        pytest.param(lambda c: der(c), id="der"),
        pytest.param(lambda c: rewrapped(c, 76), id="pem-wrapped-at-76-crlf"),
        pytest.param(lambda c: b"x" * (1 << 20) + pem(c), id="pem-across-a-read-boundary"),
    ],
)
def test_the_proxy_ca_is_found_however_it_is_stored(bundle, certs, stored) -> None:
    image = saved_image({"usr/local/share/ca-certificates/proxy.crt": stored(certs["proxy"])})
    result = check(bundle, image)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.startswith("FAIL: img holds private CA certificates")


def test_a_bundle_without_private_certificates_has_nothing_to_look_for(tmp_path, bundle, certs) -> None:
    only_public = tmp_path / "public.crt"
    only_public.write_bytes(pem(certs["public"]))
    result = check({**bundle, "bundle": str(only_public)}, saved_image({"a": b"b"}))
    assert result.returncode == 0
    assert "no private certificates" in result.stdout


def test_a_missing_bundle_is_bad_input(tmp_path, bundle) -> None:
    result = check({**bundle, "bundle": str(tmp_path / "missing.crt")}, b"")
    assert result.returncode == 2
    assert "missing.crt" in result.stderr
