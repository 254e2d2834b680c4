; Inno Setup script: Setup.exe for Checkpoint Chat (Windows 10/11, x64).
;
; Build the one-folder app first, then compile this script:
;   pyinstaller --noconfirm --distpath dist --workpath build\pyinstaller installer\checkpoint_chat.spec
;   "C:\Program Files (x86)\Inno Setup 6\ISCC.exe" installer\checkpoint_chat.iss
;
; Installs per user by default (no administrator rights; the user may choose "all users"),
; adds a Start menu entry, and associates .kvckpt files with the windowed app: a
; double-click runs `CheckpointChat.exe "<file>"`, which offers to resume it.
; Uninstalling removes the program folder and the association only: checkpoints,
; settings and logs in %LOCALAPPDATA%\CheckpointChat (platformdirs) stay.

#define AppName "Checkpoint Chat"
#define AppVersion "0.1.0"
#define AppExe "CheckpointChat.exe"
#define CliExe "checkpoint-chat.exe"
#define ProgId "CheckpointChat.Checkpoint"
#define Ext ".kvckpt"
#define MimeType "application/x-kvckpt"

[Setup]
AppId={{6C0E5B0A-3D1F-4C8E-9A57-2F4B7D1C9E21}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=Checkpoint Chat
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
ChangesAssociations=yes
UninstallDisplayIcon={app}\{#AppExe}
OutputDir=..\dist
OutputBaseFilename=CheckpointChat-{#AppVersion}-Setup
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern

[Files]
Source: "..\dist\CheckpointChat\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\{#AppExe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Registry]
; HKA = HKCU for a per-user install, HKLM for all users.  Only our own ProgId key is
; deleted on uninstall; .kvckpt's default value is removed only while it still points to us.
Root: HKA; Subkey: "Software\Classes\{#Ext}"; ValueType: string; ValueName: ""; ValueData: "{#ProgId}"; Flags: uninsdeletevalue
Root: HKA; Subkey: "Software\Classes\{#Ext}"; ValueType: string; ValueName: "Content Type"; ValueData: "{#MimeType}"
Root: HKA; Subkey: "Software\Classes\{#Ext}\OpenWithProgids"; ValueType: string; ValueName: "{#ProgId}"; ValueData: ""; Flags: uninsdeletevalue
Root: HKA; Subkey: "Software\Classes\{#ProgId}"; ValueType: string; ValueName: ""; ValueData: "Checkpoint Chat checkpoint"; Flags: uninsdeletekey
Root: HKA; Subkey: "Software\Classes\{#ProgId}\DefaultIcon"; ValueType: string; ValueName: ""; ValueData: "{app}\{#AppExe},0"
Root: HKA; Subkey: "Software\Classes\{#ProgId}\shell\open\command"; ValueType: string; ValueName: ""; ValueData: """{app}\{#AppExe}"" ""%1"""
Root: HKA; Subkey: "Software\Classes\Applications\{#AppExe}\SupportedTypes"; ValueType: string; ValueName: "{#Ext}"; ValueData: ""; Flags: uninsdeletekey

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

; No [UninstallDelete] entry for user data, on purpose: %LOCALAPPDATA%\CheckpointChat
; holds the user's checkpoints.  Only files the installer wrote are removed.

[Messages]
UninstalledAll=%1 was removed. Your checkpoints and settings were kept in %LOCALAPPDATA%\CheckpointChat; delete that folder yourself if you no longer need them.
