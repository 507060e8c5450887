"""Authorization: the auth service (slots, join queue, signed tickets) and its client."""

from .admission import AdmissionPolicy
from .client import (
    AuthError,
    AuthFailed,
    Authorization,
    AuthRejected,
    PeerUnreachable,
    StageAssignment,
    authorize,
    leave,
    renew_ticket,
    report_active,
    swarm_status,
)
from .identity import (
    HuggingFaceIdentity,
    IdentityError,
    IdentitySource,
    IdentityUnavailable,
    InvalidToken,
    TokenFileIdentity,
    write_demo_token_file,
)
from .secret import Secret
from .server import AuthServer, AuthService, ServiceSettings
from .tickets import (
    InvalidTicket,
    TicketClaims,
    generate_signing_key,
    issue_ticket,
    load_or_create_signing_key,
    load_public_key,
    load_signing_key,
    public_key_text,
    save_signing_key,
    verify_ticket,
)

__all__ = [
    "AdmissionPolicy", "AuthError", "AuthFailed", "AuthRejected", "AuthServer", "AuthService", "Authorization",
    "HuggingFaceIdentity", "IdentityError", "IdentitySource", "IdentityUnavailable", "InvalidTicket", "InvalidToken",
    "PeerUnreachable", "Secret", "ServiceSettings", "StageAssignment", "TicketClaims", "TokenFileIdentity", "authorize",
    "generate_signing_key", "issue_ticket", "leave", "load_or_create_signing_key", "load_public_key", "load_signing_key", "public_key_text",
    "renew_ticket", "report_active", "save_signing_key", "swarm_status", "verify_ticket", "write_demo_token_file",
]
