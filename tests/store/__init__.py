"""Tests of the DynamoDB store against a real (moto) DynamoDB endpoint."""
