# checks.vm: the NixOS module on a real NixOS VM (runNixOSTest).  Two users
# with lingering user managers, the socket-activated dispatcher on the one
# proxy port, a web server on a second machine; per user an allowed and a
# refused request through the proxy, the PreToolUse hook's refusal (a key in
# their own home), the installed drop-in equal to what the user's own
# renderer gives (the SessionStart hook's drift check), and the policy helper
# it names giving each user's sessions their own policy (alice's own deny).
{ self }:
{
  name = "agentsandbox";

  nodes.web =
    { ... }:
    {
      networking.firewall.allowedTCPPorts = [ 80 ];
      services.nginx = {
        enable = true;
        virtualHosts."allowed.example.org".locations."/".return = "200 'hello from web\\n'";
        virtualHosts."refused.example.org".locations."/".return = "200 'should never be seen\\n'";
      };
    };

  nodes.machine =
    { nodes, ... }:
    let
      webIP = nodes.web.networking.primaryIPAddress;
    in
    {
      imports = [ self.nixosModules.default ];
      networking.hosts.${webIP} = [
        "allowed.example.org"
        "refused.example.org"
      ];
      users.users = {
        alice = {
          isNormalUser = true;
          linger = true;
        };
        bob = {
          isNormalUser = true;
          linger = true;
        };
      };
      services.agentsandbox = {
        enable = true;
        users = [
          "alice"
          "bob"
        ];
        settings = {
          sandbox = {
            write = [ "~/src" ];
            # The test network is private (RFC 1918): a CIDR entry opens it.
            domains = [
              "allowed.example.org"
              "${webIP}/32:80"
            ];
          };
          # No GitHub token source in a VM.
          inject = [ ];
        };
      };
    };

  testScript = ''
    start_all()
    web.wait_for_unit("nginx.service")
    web.wait_for_open_port(80)
    machine.wait_for_unit("agentsandbox-dispatch.socket")
    machine.wait_for_open_port(3190)

    for user in ("alice", "bob"):
        machine.wait_for_unit("agentsandbox.service", user)

    def as_user(user, command):
        return f"su - {user} -c 'XDG_RUNTIME_DIR=/run/user/$(id -u {user}) {command}'"

    for user in ("alice", "bob"):
        out = machine.succeed(as_user(user, "curl -sS --max-time 20 -x http://127.0.0.1:3190 http://allowed.example.org/"))
        assert "hello from web" in out, out
        code = machine.succeed(as_user(user, "curl -s -o /dev/null -w %{http_code} --max-time 20 -x http://127.0.0.1:3190 http://refused.example.org/"))
        assert code.strip() == "403", code

        # The file-tool hook refuses a path in the user's own home that no list opens.
        request = f'{{"hook_event_name": "PreToolUse", "tool_name": "Read", "tool_input": {{"file_path": "/home/{user}/.ssh/id_ed25519"}}, "cwd": "/home/{user}"}}'
        machine.succeed(f"echo '{request}' > /tmp/hook-{user}.json && chmod 0644 /tmp/hook-{user}.json")
        decision = machine.succeed(as_user(user, f"agentsandbox hook pretooluse < /tmp/hook-{user}.json"))
        assert '"permissionDecision": "deny"' in decision and "sandbox.read" in decision, decision

        # What the user's renderer gives is what the module installed.
        machine.succeed(as_user(user, f"agentsandbox render claude > /tmp/render-{user}.json"))
        machine.succeed(f"cmp /tmp/render-{user}.json /etc/claude-code/managed-settings.d/50-agentsandbox.json")

    # The drop-in names the package's policy helper; run as each user (as
    # Claude Code runs it), it prints that user's session settings: alice's
    # own config adds a deny, bob's sessions do not get it.
    import json
    dropin = json.loads(machine.succeed("cat /etc/claude-code/managed-settings.d/50-agentsandbox.json"))
    helper = dropin["policyHelper"]["path"]
    assert helper.startswith("/nix/store/") and helper.endswith("/bin/agentsandbox-policy-helper"), helper
    machine.succeed("install -d -o alice -m 0755 /home/alice/.config /home/alice/.config/agentsandbox")
    machine.succeed("printf '[sandbox]\\ndeny = [\"~/src/secret\"]\\n' > /home/alice/.config/agentsandbox/config.toml")
    machine.succeed("chown alice /home/alice/.config/agentsandbox/config.toml")
    for user in ("alice", "bob"):
        session = json.loads(machine.succeed(as_user(user, helper)))["managedSettings"]
        assert "policyHelper" not in session, session
        assert session["hooks"] == dropin["hooks"], session["hooks"]
        denied = "~/src/secret" in session["sandbox"]["filesystem"]["denyRead"]
        assert denied == (user == "alice"), (user, session["sandbox"]["filesystem"]["denyRead"])
  '';
}
