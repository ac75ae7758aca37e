"""Networking pieces shared by every kvctl listener: authentication and bind policy."""
