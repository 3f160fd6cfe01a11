"""Domain services (bots, chat, notifications, ...), each behind the store and bus interfaces."""
